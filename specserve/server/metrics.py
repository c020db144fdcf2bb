"""Prometheus metrics in vLLM's schema, on a registry owned by one app.

Counters are exported with the ``_total`` suffix (prometheus_client adds it),
e.g. ``vllm:spec_decode_num_draft_tokens_total{model_name="..."}``. Engine
gauges (running, waiting, KV usage) and the preemption counter are read from
``engine.stats()`` at scrape time. The speculative counters move by exactly the
per-request AcceptanceStats of finished requests.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specserve.engine.types import EngineStats, RequestOutput, AcceptanceStats

logger = logging.getLogger("specserve.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineGauges(Collector):
    """vllm:num_requests_running / waiting, vllm:kv_cache_usage_perc and vllm:num_preemptions
    (a counter), read at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self):
        try:
            s = self._stats()
        except Exception:  # a scrape must never take the server down
            logger.exception("engine.stats() failed during a metrics scrape")
            return
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = all blocks in use.", s.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(value))
            yield g
        c = CounterMetricFamily("vllm:num_preemptions", "Sequences preempted because the KV pool was full.",
                                labels=["model_name"])
        c.add_metric([self._model], float(s.num_preemptions))
        yield c


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats], spec_enabled: bool = False):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, lbl = self.registry, ["model_name"]
        # without speculation the spec series are not exported at all (absent = "not drafting",
        # never a misleading 0 accepted)
        spec_reg = reg if spec_enabled else None
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative verification steps.", lbl,
                                  registry=spec_reg)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", lbl,
                                        registry=spec_reg)
        self.num_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lbl,
                                    registry=spec_reg)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position.", lbl + ["position"],
                                        registry=spec_reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", lbl, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", lbl, registry=reg)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                     lbl, registry=reg)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lbl,
                                  registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests.", lbl + ["finished_reason"],
                                       registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lbl,
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", lbl,
                             buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", lbl,
                             buckets=_E2E_BUCKETS, registry=reg)
        reg.register(_EngineGauges(engine_stats, model_name))
        # export zeros from the start, so a scraper sees the series before the first request
        for series in (self.prompt_tokens, self.generation_tokens, self.cache_queries, self.cache_hits,
                       self.num_drafts, self.num_draft_tokens, self.num_accepted, self.ttft, self.itl, self.e2e):
            series.labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)

    def record_finished(self, last: RequestOutput | None, finish_reason: str, e2e: float) -> None:
        """One ended request; ``last`` None: it ended before its first output (an abort during its
        prefill), with no tokens counted (vLLM counts a prompt's tokens at its first token)."""
        m = self.model_name
        self.request_success.labels(m, finish_reason).inc()
        self.e2e.labels(m).observe(e2e)
        if last is None:
            return
        self.prompt_tokens.labels(m).inc(last.prompt_tokens)
        self.generation_tokens.labels(m).inc(last.completion_tokens)
        self.cache_queries.labels(m).inc(last.prompt_tokens)
        self.cache_hits.labels(m).inc(last.cached_tokens)
        if last.acceptance is not None:
            self.record_spec(last.acceptance)

    def record_spec(self, spec: AcceptanceStats) -> None:
        m = self.model_name
        self.num_drafts.labels(m).inc(spec.steps)
        self.num_draft_tokens.labels(m).inc(spec.draft_tokens)
        self.num_accepted.labels(m).inc(spec.accepted_tokens)
        for pos, n in enumerate(spec.accepted_per_pos):
            self.accepted_per_pos.labels(m, str(pos)).inc(n)


class RequestTracker:
    """Latency bookkeeping for one engine request (one choice)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last_time: float | None = None
        self.last: RequestOutput | None = None

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics.model_name
        n = len(out.new_token_ids)
        if n and self.last_time is None:
            ttft = out.first_token_latency if out.first_token_latency is not None else now - self.arrival
            self.metrics.ttft.labels(m).observe(ttft)
            self.last_time = now
        elif n:
            per_token = (now - self.last_time) / n
            for _ in range(n):
                self.metrics.itl.labels(m).observe(per_token)
            self.last_time = now
        self.last = out

    def finish(self, finish_reason: str | None) -> None:
        """The request ended (without a reason, or before any output: aborted)."""
        self.metrics.record_finished(self.last, finish_reason or "abort", time.monotonic() - self.arrival)
