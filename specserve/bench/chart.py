"""PNG chart of tok/s per suite per configuration, annotated with acceptance (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specserve.errors import SpecserveError


def _annotation(acc: dict[str, Any]) -> str:
    if acc.get("available"):
        if acc.get("acceptance_rate") is None:
            return "no drafts"
        return f"acc {acc['acceptance_rate']:.2f}\nlen {acc['mean_acceptance_length'] or 0:.2f}"
    return "no spec\ncounters"


def write_chart(result: dict[str, Any], path: str | Path) -> None:
    """Grouped bars (median tok/s, min–max whiskers) per suite and configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SpecserveError("--chart needs matplotlib (pip install matplotlib)") from exc
    suites = result["summary"]["suites"]
    if not suites:
        raise SpecserveError("--chart: no suite was measured, nothing to draw")
    labels = [c["label"] for c in result["configs"]]
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(suites) * len(labels) / 1.5), 4.5), dpi=120)
    for i, label in enumerate(labels):
        xs, meds, lo, hi, notes = [], [], [], [], []
        for j, entry in enumerate(suites.values()):
            c = entry["configs"][label]
            if not c["tok_s"]:
                continue
            s = c["tok_s"]
            xs.append(j + (i - (len(labels) - 1) / 2) * width)
            meds.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
            notes.append(_annotation(c["acceptance"]))
        bars = ax.bar(xs, meds, width * 0.95, yerr=[lo, hi], capsize=3, label=label)
        for bar, med, top, note in zip(bars, meds, hi, notes):
            ax.annotate(f"{med:.1f}\n{note}", (bar.get_x() + bar.get_width() / 2, med + top),
                        xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ticks = []
    for name, entry in suites.items():
        speedup = entry.get("speedup")
        ticks.append(f"{name}\nspeedup {speedup:.2f}x" if speedup else name)
    ax.set_xticks(range(len(suites)), ticks)
    ax.set_ylabel("tok/s (median, min–max)")
    m = result["method"]
    ax.set_title(f"specserve bench: temperature 0, {m['max_tokens']} tokens, {m['runs']} run(s)", fontsize=10)
    ax.margins(y=0.25)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
