"""Turn a results dict into tables: rich on the terminal, Markdown for a README, JSON on disk.

Both renderers share ``sections()``, so the terminal and the Markdown say the same thing.
A missing measurement is printed as ``n/a`` with its reason, never as a bare null.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


@dataclass
class Section:
    """One table plus the lines printed under it (``loud`` lines are warnings)."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loud: list[str] = field(default_factory=list)


def num(value: Any, digits: int = 1) -> str:
    """A number, or n/a."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def rate_cell(spread: dict[str, Any] | None) -> tuple[str, str]:
    """(median, "min–max") of a tok/s spread."""
    if not spread:
        return "n/a", "n/a"
    return num(spread["median"]), f"{num(spread['min'])}–{num(spread['max'])}"


def acceptance_cells(acc: dict[str, Any]) -> tuple[str, str]:
    """(acceptance rate, mean acceptance length) cells for one acceptance record."""
    if acc.get("available"):
        if acc.get("acceptance_rate") is None:
            return "no drafts", "n/a"
        rate = f"{acc['acceptance_rate']:.3f} ({acc['accepted_tokens']}/{acc['draft_tokens']})"
        return rate, num(acc.get("mean_acceptance_length"), 2)
    usage = acc.get("from_usage")
    if usage and usage.get("acceptance_rate") is not None:
        return (f"NO COUNTERS; usage says {usage['acceptance_rate']:.3f}",
                num(usage.get("mean_acceptance_length"), 2))
    return "NO COUNTERS", "n/a"


def determinism_cell(det: dict[str, Any]) -> str:
    """yes / NO (k prompts) / n/a (reason)."""
    if det["deterministic"] is None:
        return "n/a (1 run)"
    if det["deterministic"]:
        return "yes"
    return f"NO ({len(det['nondeterministic_prompts'])} prompts)"


def suite_section(result: dict[str, Any]) -> Section:
    """The main table: tok/s, determinism, acceptance, speedup and losslessness per suite."""
    labels = [c["label"] for c in result["configs"]]
    ab = len(labels) == 2
    headers = ["suite", "config", "tok/s (median)", "min–max", "ok/requests", "self-deterministic",
               "acceptance (/metrics)", "mean accept len"]
    if ab:
        headers += [f"speedup {labels[0]}/{labels[1]}", "identical answers"]
    sec = Section(f"Suites — temperature 0, non-streaming, max_tokens {result['method']['max_tokens']}, "
                  f"median of {result['method']['runs']} run(s) x prompts, client wall clock", headers)
    for suite, entry in result["summary"]["suites"].items():
        for i, label in enumerate(labels):
            c = entry["configs"][label]
            med, rng = rate_cell(c["tok_s"])
            row = [suite if i == 0 else "", label, med, rng, f"{c['ok']}/{c['requests']}",
                   determinism_cell(c["determinism"]), *acceptance_cells(c["acceptance"])]
            if ab:
                loss = entry["lossless"]
                row += [num(entry["speedup"], 2) + "x" if entry["speedup"] else "n/a",
                        f"{loss['identical']}/{loss['compared']}"] if i == 0 else ["", ""]
            sec.rows.append(row)
            if c["errors"]:
                first = c["errors"][0]
                sec.loud.append(f"{suite} [{label}]: {len(c['errors'])} request(s) failed, first: "
                                f"{first['prompt_id']} run {first['run'] + 1}: {first['error']}")
    return sec


def acceptance_notes(result: dict[str, Any], sec: Section) -> None:
    """Loud lines for missing counters and cross-check disagreements."""
    for label, entry in result["summary"]["overall"].items():
        acc = entry["acceptance"]
        if acc.get("message"):
            sec.loud.append(f"[{label}] {acc['message']}")
        elif acc.get("available"):
            sec.notes.append(f"[{label}] overall acceptance {acc['acceptance_rate']:.3f}, mean "
                             f"acceptance length {num(acc.get('mean_acceptance_length'), 2)} "
                             f"({acc['source']} counters at {acc['metrics_url']})")
        for line in acc["cross_check"]["disagreements"]:
            sec.loud.append(f"[{label}] /metrics vs per-request usage disagree: {line}")


def lossless_section(result: dict[str, Any]) -> Section | None:
    """Prompts whose candidate and baseline answers differ, with the first difference."""
    labels = [c["label"] for c in result["configs"]]
    if len(labels) != 2:
        return None
    sec = Section(f"Losslessness — {labels[0]} vs {labels[1]} (first successful run of each)",
                  ["suite", "prompt", "first diff token", "first diff char", "tokens A/B", "unit"])
    for suite, entry in result["summary"]["suites"].items():
        loss = entry["lossless"]
        sec.notes.append(f"{suite}: {loss['identical']} of {loss['compared']} prompts identical, "
                         f"{loss['differ']} differ")
        for p in loss["prompts"]:
            if not p["identical"]:
                sec.rows.append([suite, p["id"], num(p["first_diff_token"], 0),
                                 num(p["first_diff_char"], 0), f"{p['a_tokens']}/{p['b_tokens']}",
                                 loss["unit"]])
        for p in loss["not_compared"]:
            sec.loud.append(f"{suite}: {p['id']} not compared ({p['reason']})")
    return sec


def run_label(run: dict[str, Any]) -> str:
    """A scenario run's label, with its --ab round when there were several."""
    return run["label"] + (f" #{run['round'] + 1}" if run.get("round") else "")


def prefix_section(runs: list[dict[str, Any]]) -> Section:
    """Cold vs warm TTFT over a shared prefix."""
    sec = Section("Shared prefix — cold vs warm time to first token",
                  ["config", "questions", "prompt tokens", "cold TTFT s", "warm TTFT s (median)",
                   "cold/warm", "cached tokens (warm)"])
    for r in runs:
        cached = num(r["warm_cached_tokens"], 0) if r["cached_tokens_reported"] else "not reported"
        warm = r["warm_ttft_s"]["median"] if r["warm_ttft_s"] else None
        sec.rows.append([run_label(r), str(r["rounds"]), num(r["prompt_tokens"], 0),
                         num(r["cold_ttft_s"], 3), num(warm, 3), num(r["cold_over_warm"], 2), cached])
        sec.notes.append(f"{r['label']}: TTFT by {r['ttft_method']}; document: {r['document_source']}")
    return sec


def needle_section(runs: list[dict[str, Any]]) -> Section:
    """Needle found or not, per length, with prefill speed."""
    sec = Section("Needle in a haystack", ["config", "target tokens", "prompt tokens", "TTFT s",
                                           "prefill tok/s", "total s", "needle"])
    for r in runs:
        for row in r["rows"]:
            status = "found" if row["found"] else ("ERROR" if not row["ok"] else "missed")
            sec.rows.append([run_label(r), str(row["target_tokens"]), num(row["prompt_tokens"], 0),
                             num(row["ttft_s"], 3), num(row["prefill_tok_s"], 0),
                             num(row["wall_s"], 2), status])
            if row["error"]:
                sec.loud.append(f"{r['label']} needle {row['target_tokens']}: {row['error']}")
        sec.notes.append(f"{r['label']}: depth {r['depth']}, {r['found']}/{r['lengths']} found; "
                         f"document: {r['document_source']}")
    return sec


def concurrency_section(runs: list[dict[str, Any]]) -> Section:
    """Aggregate vs per-request tok/s by number of concurrent clients."""
    sec = Section("Concurrency", ["config", "clients", "aggregate tok/s", "per-request tok/s (median)",
                                  "min–max", "ok/requests"])
    for r in runs:
        for lv in r["levels"]:
            med, rng = rate_cell(lv["per_request_tok_s"])
            sec.rows.append([run_label(r), str(lv["concurrency"]), num(lv["aggregate_tok_s"]), med, rng,
                             f"{lv['ok']}/{lv['requests']}"])
            if lv["errors"]:
                sec.loud.append(f"{r['label']} x{lv['concurrency']}: {len(lv['errors'])} failed, "
                                f"first: {lv['errors'][0]}")
    return sec


def sections(result: dict[str, Any]) -> list[Section]:
    """Every table of a results dict, in display order."""
    out: list[Section] = []
    if result["summary"]["suites"]:
        main = suite_section(result)
        acceptance_notes(result, main)
        out.append(main)
        loss = lossless_section(result)
        if loss:
            out.append(loss)
    builders = {"prefix": prefix_section, "needle": needle_section, "concurrency": concurrency_section}
    for name, runs in result["scenarios"].items():
        out.append(builders[name](runs))
    if result["notes"]:
        out.append(Section("Notes", [], notes=list(result["notes"])))
    return out


def print_rich(result: dict[str, Any], console: Console) -> None:
    """Print every section as a rich table."""
    for sec in sections(result):
        if sec.headers and sec.rows:
            table = Table(title=sec.title, title_justify="left")
            for h in sec.headers:
                table.add_column(h)
            for row in sec.rows:
                table.add_row(*[f"[bold red]{c}[/]" if c.startswith(("NO", "ERROR")) else c for c in row])
            console.print(table)
        else:
            console.print(f"[bold]{sec.title}[/]")
        for line in sec.notes:
            console.print(f"  {line}", markup=False, highlight=False)
        for line in sec.loud:
            console.print(f"  [bold red]WARNING:[/] {escape(line)}")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(result: dict[str, Any]) -> str:
    """The same sections as Markdown tables."""
    lines = [f"# specserve bench — {result['created']}", ""]
    for c in result["configs"]:
        lines.append(f"- **{c['label']}**: {c['url']} model `{c['model']}`"
                     + (f", serve args `{c['serve_args']}`" if c.get("serve_args") else ""))
    lines.append("")
    for sec in sections(result):
        lines += [f"## {sec.title}", ""]
        if sec.headers and sec.rows:
            lines.append("| " + " | ".join(sec.headers) + " |")
            lines.append("|" + "---|" * len(sec.headers))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in sec.rows]
            lines.append("")
        lines += [f"- {_md_cell(n)}" for n in sec.notes]
        lines += [f"- **WARNING: {_md_cell(n)}**" for n in sec.loud]
        lines.append("")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """Write the full results (every raw measurement) as JSON."""
    Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
