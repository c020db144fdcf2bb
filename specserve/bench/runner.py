"""Drive the measurements: interleaved A/B suites against URLs, or sequential ``--ab`` servers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from specserve.bench import metrics
from specserve.bench import scenarios as sc
from specserve.bench.scenarios import TtftOptions
from specserve.bench.client import BenchClient, RequestResult
from specserve.bench.serverproc import ManagedServer, free_port, serve_argv
from specserve.bench.suites import Prompt


class Hook(Protocol):
    """Progress callback: ``advance`` requests finished, now doing ``description``."""

    def __call__(self, description: str, advance: int = 1) -> None: ...


def no_hook(description: str, advance: int = 1) -> None:
    """A hook that ignores progress."""


@dataclass
class Plan:
    """What to measure and how."""

    suites: dict[str, list[Prompt]]
    runs: int = 3
    max_tokens: int = 512
    warmup: int = 1
    scenarios: list[str] = field(default_factory=lambda: ["suites"])
    document: str = ""
    document_source: str = ""
    prefix_tokens: int = 4096
    rounds: int = 4
    lengths: list[int] | None = None
    context_max: int | None = None
    depth: float = 0.5
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    requests_per_client: int = 2
    ttft: TtftOptions = field(default_factory=TtftOptions)

    def request_count(self, n_targets: int) -> int:
        """How many requests the suites take (for the progress bar)."""
        if "suites" not in self.scenarios:
            return 0
        per = sum(len(p) for p in self.suites.values()) * self.runs + self.warmup
        return per * n_targets


@dataclass
class Target:
    """One configuration under test."""

    label: str
    client: BenchClient
    info: dict[str, Any]


@dataclass
class RunLog:
    """Every raw measurement of a bench run."""

    requests: list[RequestResult] = field(default_factory=list)
    warmups: list[RequestResult] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    scenarios: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


ClientFactory = Callable[[str], BenchClient]


def make_target(label: str, url: str, factory: ClientFactory, **info: Any) -> Target:
    """Connect, resolve the model name and read /version."""
    client = factory(url)
    try:
        model = client.resolve_model()
    except BaseException:
        client.close()
        raise
    return Target(label, client, {"label": label, "url": client.root, "model": model,
                                  "version": client.version(), **info})


def warm_up(targets: list[Target], plan: Plan, log: RunLog, hook: Hook) -> None:
    """Untimed requests before measuring (kept in the log, excluded from every statistic)."""
    first = next(iter(plan.suites.values()))[0]
    for i in range(plan.warmup):
        for t in targets:
            res = RequestResult(t.label, "warmup", first.id, run=i)
            log.warmups.append(t.client.complete(first, min(plan.max_tokens, 16), res))
            hook(f"warm-up {t.label}")


def run_suites(targets: list[Target], plan: Plan, log: RunLog, hook: Hook, round_: int = 0) -> None:
    """Each prompt, each run, each target in turn (A, B, A, B ...); /metrics around each suite."""
    for suite, prompts in plan.suites.items():
        before = {t.label: metrics.scrape(t.client) for t in targets}
        for prompt in prompts:
            for run in range(plan.runs):
                for t in targets:
                    res = RequestResult(t.label, suite, prompt.id, run=run, round=round_)
                    log.requests.append(t.client.complete(prompt, plan.max_tokens, res))
                    hook(f"{suite} {prompt.id} run {run + 1}/{plan.runs} [{t.label}]")
        for t in targets:
            delta = metrics.counter_delta(before[t.label], metrics.scrape(t.client))
            log.windows.append({"label": t.label, "suite": suite, "round": round_, "delta": delta})


def run_scenarios(target: Target, plan: Plan, log: RunLog, hook: Hook = no_hook,
                  round_: int = 0) -> None:
    """The non-suite scenarios of the plan, against one target."""
    c, label = target.client, target.label
    for name in plan.scenarios:
        if name != "suites":
            hook(f"scenario {name} [{label}]", 0)
        if name == "prefix":
            out = sc.prefix(c, label, plan.document, plan.prefix_tokens, plan.rounds, plan.ttft)
        elif name == "needle":
            out = sc.needle(c, label, plan.document, needle_lengths(c, plan, log), plan.depth,
                                   plan.ttft)
        elif name == "concurrency":
            prompts = next(iter(plan.suites.values()))
            out = sc.concurrency(c, label, prompts, plan.concurrency,
                                        plan.requests_per_client, plan.max_tokens)
        else:
            continue
        if name in ("prefix", "needle"):
            out["document_source"] = plan.document_source
        log.scenarios.setdefault(name, []).append(out | {"round": round_})


def needle_lengths(client: BenchClient, plan: Plan, log: RunLog) -> list[int]:
    """--lengths, else powers of two up to 3/4 of the context (--context-max or the server's)."""
    if plan.lengths:
        return plan.lengths
    ctx = plan.context_max or client.context_length()
    if ctx is None:
        ctx = 8192
        log.notes.append("needle: the server does not advertise its context length; assumed 8192 "
                         "(pass --context-max or --lengths)")
    return sc.default_lengths(ctx)


def run_session(targets: list[Target], plan: Plan, log: RunLog, hook: Hook, round_: int = 0) -> None:
    """Suites (interleaved over the targets) then scenarios (one target after the other)."""
    if "suites" in plan.scenarios:
        if plan.warmup:
            warm_up(targets, plan, log, hook)
        run_suites(targets, plan, log, hook, round_)
    for t in targets:
        run_scenarios(t, plan, log, hook, round_)


class TokenCache:
    """Memoised /tokenize of one server (usable after the server is gone for prefetched texts)."""

    def __init__(self, client: BenchClient | None):
        self.client = client
        self.name = f"{client.root}/tokenize" if client else None
        self.cache: dict[str, list[int] | None] = {}

    def __call__(self, text: str) -> list[int] | None:
        if text not in self.cache:
            self.cache[text] = self.client.tokenize(text) if self.client else None
        return self.cache[text]

    def prefetch(self, requests: list[RequestResult]) -> None:
        """Tokenize the answer each prompt's comparison will use (first good run per config)."""
        seen: set[tuple[str, str, str]] = set()
        for r in requests:
            key = (r.config, r.suite, r.prompt_id)
            if r.ok and key not in seen:
                seen.add(key)
                if self(r.text or "") is None:
                    return


Starter = Callable[[str, str, int], ManagedServer]


def default_starter(serve_args: str, label: str, startup_timeout: int) -> ManagedServer:
    """Start ``python -m specserve serve <args>`` on a free port."""
    port = free_port()
    return ManagedServer(serve_argv(serve_args, port), port, label, startup_timeout).start()


def run_ab(configs: list[tuple[str, str]], rounds: int, plan: Plan, factory: ClientFactory,
           hook: Hook, starter: Starter = default_starter,
           startup_timeout: int = 600) -> tuple[RunLog, list[dict[str, Any]], TokenCache]:
    """Start each configuration's server in turn (A, B, A, B ... for ``rounds``) and measure it."""
    log, infos, tokens = RunLog(), {}, TokenCache(None)
    if len(configs) > 1:
        log.notes.append("--ab: each configuration ran on its own server, one after the other; "
                         "runs were sequential per configuration, not interleaved")
    for rnd in range(rounds):
        for i, (label, serve_args) in enumerate(configs):
            t0 = time.monotonic()
            server = starter(serve_args, label, startup_timeout)
            try:
                target = make_target(label, server.url, factory, serve_args=serve_args)
                target.info["startup_s"] = time.monotonic() - t0
                run_session([target], plan, log, hook, rnd)
                infos.setdefault(label, target.info)
                if rnd == rounds - 1 and i == len(configs) - 1:
                    tokens = TokenCache(target.client)
                    tokens.prefetch(log.requests)
                target.client.close()
            finally:
                server.stop()
    return log, [infos[label] for label, _ in configs], tokens
