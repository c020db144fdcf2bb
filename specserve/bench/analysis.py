"""Pure summaries of measured requests: rates, determinism, losslessness, acceptance."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Callable, Iterable, Sequence

from specserve.bench import metrics
from specserve.bench.client import RequestResult

Tokenizer = Callable[[str], "list[int] | None"]


def spread(values: Iterable[float]) -> dict[str, Any] | None:
    """Median, min, max and count of some values; None when there are none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def first_diff(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first differing element (len of the shorter if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _by_prompt(results: Iterable[RequestResult]) -> dict[str, list[RequestResult]]:
    out: dict[str, list[RequestResult]] = {}
    for r in results:
        out.setdefault(r.prompt_id, []).append(r)
    return out


def determinism(results: list[RequestResult]) -> dict[str, Any]:
    """Whether every run of every prompt gave the same answer hash."""
    groups = {pid: [r.sha256 for r in rs if r.ok] for pid, rs in _by_prompt(results).items()}
    checked = {pid: h for pid, h in groups.items() if len(h) >= 2}
    out: dict[str, Any] = {"checked_prompts": len(checked),
                           "unchecked_prompts": sorted(set(groups) - set(checked))}
    out["nondeterministic_prompts"] = sorted(p for p, h in checked.items() if len(set(h)) > 1)
    if not checked:
        out["deterministic"] = None
        out["note"] = "not checked: fewer than 2 successful runs per prompt"
    else:
        out["deterministic"] = not out["nondeterministic_prompts"]
        out["note"] = ""
    return out


def config_summary(results: list[RequestResult]) -> dict[str, Any]:
    """Per-suite, per-configuration numbers: tok/s spread, errors, determinism."""
    ok = [r for r in results if r.ok]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": [{"prompt_id": r.prompt_id, "run": r.run, "round": r.round, "error": r.error}
                   for r in results if not r.ok],
        "tok_s": spread(r.tok_s for r in ok),
        "wall_s": spread(r.wall_s for r in ok),
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
        "determinism": determinism(results),
    }


def _first_ok(results: list[RequestResult]) -> RequestResult | None:
    return next((r for r in results if r.ok), None)


def compare_pair(a: RequestResult, b: RequestResult, tokenize: Tokenizer | None) -> dict[str, Any]:
    """Identity of two answers and, if they differ, where they first differ."""
    a_text, b_text = a.text or "", b.text or ""
    out: dict[str, Any] = {"id": a.prompt_id, "identical": a.sha256 == b.sha256,
                           "a_sha256": a.sha256, "b_sha256": b.sha256,
                           "a_tokens": a.completion_tokens, "b_tokens": b.completion_tokens,
                           "first_diff_char": None, "first_diff_token": None}
    if out["identical"]:
        return out
    idx = first_diff(a_text, b_text)
    out["first_diff_char"] = idx
    if idx is not None:
        out["a_context"] = a_text[max(0, idx - 30): idx + 30]
        out["b_context"] = b_text[max(0, idx - 30): idx + 30]
    ta = tokenize(a_text) if tokenize else None
    tb = tokenize(b_text) if tokenize and ta is not None else None
    if ta is not None and tb is not None:
        out["first_diff_token"] = first_diff(ta, tb)
    return out


def lossless(a_results: list[RequestResult], b_results: list[RequestResult],
             tokenize: Tokenizer | None, tokenizer_name: str | None) -> dict[str, Any]:
    """Compare candidate (A) and baseline (B) answers prompt by prompt (first good run of each)."""
    a_by, b_by = _by_prompt(a_results), _by_prompt(b_results)
    prompts, not_compared = [], []
    for pid in a_by.keys() | b_by.keys():
        a, b = _first_ok(a_by.get(pid, [])), _first_ok(b_by.get(pid, []))
        if a is None or b is None:
            not_compared.append({"id": pid, "reason": "no successful answer from "
                                 + ("both" if a is None and b is None else "A" if a is None else "B")})
            continue
        prompts.append(compare_pair(a, b, tokenize))
    prompts.sort(key=lambda p: p["id"])
    differ = [p for p in prompts if not p["identical"]]
    by_token = bool(differ) and all(p["first_diff_token"] is not None for p in differ)
    if by_token:
        unit = f"token (tokenized through {tokenizer_name})"
    else:
        unit = "character (no /tokenize endpoint answered)" if differ else "n/a (no difference)"
    return {"compared": len(prompts), "identical": len(prompts) - len(differ),
            "differ": len(differ), "unit": unit, "prompts": prompts,
            "not_compared": sorted(not_compared, key=lambda p: p["id"])}


def acceptance_for(windows: list[dict[str, Any]], label: str, suite: str | None,
                   results: list[RequestResult]) -> dict[str, Any]:
    """Combined /metrics delta for a label (and suite, or all suites) with its cross-check."""
    chosen = [w["delta"] for w in windows if w["label"] == label and suite in (None, w["suite"])]
    acc = metrics.combine(chosen)
    sums = metrics.usage_sums(r for r in results if r.config == label
                              and suite in (None, r.suite))
    acc["cross_check"] = metrics.cross_check(acc, sums)
    acc["from_usage"] = metrics.usage_acceptance(sums)
    return acc


def summarize(requests: list[RequestResult], suites: list[str], labels: list[str],
              windows: list[dict[str, Any]], tokenize: Tokenizer | None = None,
              tokenizer_name: str | None = None) -> dict[str, Any]:
    """Everything the report shows, from raw requests and metrics windows."""
    out: dict[str, Any] = {"suites": {}, "overall": {}}
    for suite in suites:
        entry: dict[str, Any] = {"configs": {}}
        for label in labels:
            rs = [r for r in requests if r.suite == suite and r.config == label]
            summary = config_summary(rs)
            summary["acceptance"] = acceptance_for(windows, label, suite, rs)
            entry["configs"][label] = summary
        if len(labels) == 2:
            a, b = (entry["configs"][lb]["tok_s"] for lb in labels)
            entry["speedup"] = a["median"] / b["median"] if a and b and b["median"] else None
            entry["lossless"] = lossless(
                [r for r in requests if r.suite == suite and r.config == labels[0]],
                [r for r in requests if r.suite == suite and r.config == labels[1]],
                tokenize, tokenizer_name)
        out["suites"][suite] = entry
    for label in labels:
        out["overall"][label] = {"acceptance": acceptance_for(windows, label, None, requests)}
    return out
