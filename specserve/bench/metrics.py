"""Speculative-decoding acceptance from a server's Prometheus ``/metrics`` counters.

Counters are scraped before and after each configuration's runs and differenced.
A missing counter is reported loudly as missing, never as a null that could be read as
"nothing was accepted". The per-request ``usage.speculative`` / ``timings`` sums are
a second, independent source, and a disagreement between the two is flagged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from prometheus_client.parser import text_string_to_metric_families

from specserve.bench.client import BenchClient, RequestResult

KEYS = ("draft_tokens", "accepted_tokens", "drafts")
COUNTERS: dict[str, dict[str, str]] = {
    prefix: {
        "draft_tokens": f"{prefix}:spec_decode_num_draft_tokens_total",
        "accepted_tokens": f"{prefix}:spec_decode_num_accepted_tokens_total",
        "drafts": f"{prefix}:spec_decode_num_drafts_total",
    }
    for prefix in ("vllm", "llamacpp")
}


@dataclass
class Snapshot:
    """Counter values at one moment; ``counters`` is None when there are none."""

    url: str
    counters: dict[str, float] | None
    source: str | None
    reason: str = ""


def parse_counters(text: str) -> tuple[dict[str, float] | None, str | None]:
    """Canonical counters (summed over label sets) and their naming family, from /metrics text."""
    lookup: dict[str, tuple[str, str]] = {}
    for source, names in COUNTERS.items():
        for key, name in names.items():
            lookup[name] = (source, key)
            lookup[name.removesuffix("_total")] = (source, key)
    found: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                hit = lookup.get(sample.name)
                if hit:
                    bucket = found.setdefault(hit[0], {})
                    bucket[hit[1]] = bucket.get(hit[1], 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError):
        return None, None
    for source in COUNTERS:
        values = found.get(source)
        if values and "draft_tokens" in values and "accepted_tokens" in values:
            return values, source
    return None, None


def scrape(client: BenchClient) -> Snapshot:
    """Read the speculative-decoding counters of one server."""
    url = f"{client.root}/metrics"
    text, reason = client.metrics_text()
    if text is None:
        return Snapshot(url, None, None, reason)
    counters, source = parse_counters(text)
    if counters is None:
        return Snapshot(url, None, None, "no vllm:/llamacpp: spec_decode counters in the text")
    return Snapshot(url, counters, source)


def missing_message(url: str, reason: str) -> str:
    """The loud line for a server without counters."""
    return f"no speculative-decoding counters at {url}" + (f" ({reason})" if reason else "")


def rates(d: dict[str, Any]) -> dict[str, Any]:
    """Add acceptance rate and mean acceptance length to a dict of counts."""
    draft, acc, drafts = d.get("draft_tokens"), d.get("accepted_tokens"), d.get("drafts")
    d["acceptance_rate"] = acc / draft if draft else None
    d["mean_acceptance_length"] = (acc + drafts) / drafts if drafts else None
    if not draft:
        d["message"] = (f"counters present at {d['metrics_url']} but nothing was drafted during "
                        "these runs (speculation off or not engaged)")
    return d


def counter_delta(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """Difference of two snapshots, with rates, or an unavailable record with its message."""
    out: dict[str, Any] = {"metrics_url": after.url, "available": False, "source": after.source}
    if after.counters is None:
        out["message"] = missing_message(after.url, after.reason)
        return out
    base = before.counters or {}
    delta = {k: after.counters[k] - base.get(k, 0.0) for k in KEYS if k in after.counters}
    if any(v < 0 for v in delta.values()):
        out["message"] = f"counters at {after.url} went backwards (server restarted during the run?)"
        return out
    out.update({k: _num(v) for k, v in delta.items()}, available=True, message="")
    return rates(out)


def combine(deltas: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum several deltas (e.g. suites, or --ab rounds); unavailable if any part is."""
    parts = list(deltas)
    if not parts:
        return {"available": False, "message": "no runs", "metrics_url": None, "source": None}
    for p in parts:
        if not p.get("available"):
            return dict(p)
    out: dict[str, Any] = {"metrics_url": parts[0]["metrics_url"], "source": parts[0]["source"],
                           "available": True, "message": ""}
    for k in KEYS:
        if all(k in p for p in parts):
            out[k] = _num(sum(p[k] for p in parts))
    return rates(out)


def _num(v: float) -> float | int:
    return int(v) if float(v).is_integer() else v


def usage_sums(results: Iterable[RequestResult]) -> dict[str, Any]:
    """Sum per-request ``usage.speculative`` and ``timings`` statistics of the successful requests."""
    out: dict[str, Any] = {"requests": 0, "failed": 0, "with_usage_stats": 0, "with_timings": 0}
    for r in results:
        if not r.ok:
            out["failed"] += 1
            continue
        out["requests"] += 1
        if r.speculative:
            out["with_usage_stats"] += 1
            for k in ("steps", "draft_tokens", "accepted_tokens"):
                out[f"usage_{k}"] = out.get(f"usage_{k}", 0) + (r.speculative.get(k) or 0)
        if r.timings:
            out["with_timings"] += 1
            for k in ("draft_n", "draft_n_accepted"):
                out[f"timings_{k}"] = out.get(f"timings_{k}", 0) + (r.timings.get(k) or 0)
    return out


def cross_check(acc: dict[str, Any], sums: dict[str, Any]) -> dict[str, Any]:
    """Compare /metrics deltas with per-request sums; lists every disagreement."""
    pairs = [("draft_tokens", "usage_draft_tokens"), ("accepted_tokens", "usage_accepted_tokens"),
             ("drafts", "usage_steps"), ("draft_tokens", "timings_draft_n"),
             ("accepted_tokens", "timings_draft_n_accepted")]
    out: dict[str, Any] = {**sums, "checked": [], "disagreements": []}
    if not acc.get("available"):
        out["agree"] = None
        return out
    for metric_key, sum_key in pairs:
        if metric_key in acc and sum_key in sums:
            out["checked"].append(sum_key)
            if abs(acc[metric_key] - sums[sum_key]) > 0.5:
                out["disagreements"].append(
                    f"/metrics {metric_key}={acc[metric_key]} but per-request {sum_key}={sums[sum_key]}")
    partial = [k for k in ("with_usage_stats", "with_timings") if 0 < sums[k] < sums["requests"]]
    for k in partial:
        out["disagreements"].append(f"only {sums[k]} of {sums['requests']} requests carried {k[5:]}")
    out["agree"] = (not out["disagreements"]) if out["checked"] else None
    return out


def usage_acceptance(sums: dict[str, Any]) -> dict[str, Any] | None:
    """Acceptance from per-request usage alone (labelled as such), or None without stats."""
    if "usage_draft_tokens" in sums:
        draft, acc, steps = (sums["usage_draft_tokens"], sums["usage_accepted_tokens"],
                             sums.get("usage_steps"))
    elif "timings_draft_n" in sums:
        draft, acc, steps = sums["timings_draft_n"], sums["timings_draft_n_accepted"], None
    else:
        return None
    return {"source": "per-request usage", "draft_tokens": draft, "accepted_tokens": acc,
            "acceptance_rate": acc / draft if draft else None,
            "mean_acceptance_length": (acc + steps) / steps if steps else None}
