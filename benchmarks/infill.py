"""Code infill (/infill, as an editor plugin calls it): decode speed without and with speculation.

    python benchmarks/infill.py [--model qwen2.5-coder-1.5b] [--cases 12] [--rounds 2]
        [--spec LABEL=JSON ...] [--out infill.json]   (default: suffix and ngram, each with its defaults)

The cases are holes in a file every Python has (the standard library's argparse.py, so the text
depends on the Python version; the script prints it): 1 to 3 whole lines removed at seeded random
places, the 120 lines before as input_prefix and the 40 after as input_suffix, greedy, n_predict 64.
The servers run one at a time, round by round (plain, then each --spec, then again), on one port;
reported per configuration: decode tokens per second from the server's own timings
(predicted_n / predicted_ms, summed over the cases, best round), the ratio to plain in the same
round, how many outputs equal plain's (greedy: all must), and how many fills start with the lines
that were removed (the model's quality, the same for every configuration).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import random
import sys

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specserve.bench.serverproc import ManagedServer, free_port, serve_argv  # noqa: E402

PREFIX_LINES, SUFFIX_LINES = 120, 40


def cpu() -> str:
    """The CPU's name, family and model (/proc/cpuinfo), or the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return platform.machine()
    get = {k.strip(): v.strip() for k, v in info.items()}.get
    return f"{get('model name', '?')} (family {get('cpu family', '?')} model {get('model', '?')})"


def make_cases(count: int, seed: int = 0) -> list[dict]:
    lines = inspect.getsource(argparse).split("\n")
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        i, k = rng.randrange(PREFIX_LINES, len(lines) - SUFFIX_LINES - 3), rng.randint(1, 3)
        hole = "\n".join(lines[i:i + k]) + "\n"
        if not hole.strip():
            continue
        cases.append({"input_prefix": "\n".join(lines[i - PREFIX_LINES:i]) + "\n",
                      "input_suffix": "\n".join(lines[i + k:i + k + SUFFIX_LINES]) + "\n",
                      "n_predict": 64, "temperature": 0, "hole": hole})
    return cases


def run(url: str, cases: list[dict]) -> dict:
    outs, tokens, ms = [], 0, 0.0
    with httpx.Client(base_url=url, timeout=600) as http:
        for case in cases:
            r = http.post("/infill", json={k: v for k, v in case.items() if k != "hole"})
            r.raise_for_status()
            body = r.json()
            outs.append(body["content"])
            tokens += body["timings"]["predicted_n"]
            ms += body["timings"]["predicted_ms"]
    return {"outputs": outs, "tokens": tokens, "tok_s": 1000 * tokens / ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", action="append", default=None, help="LABEL=JSON speculative config (repeatable)")
    ap.add_argument("--out", help="raw outputs, timings and the summary (JSON)")
    ap.add_argument("--markdown", help="the table (markdown)")
    args = ap.parse_args()
    default = ['suffix={"method": "suffix"}', 'ngram={"method": "ngram"}']
    specs = dict(s.split("=", 1) for s in (args.spec or default))
    configs = {"plain": "", **{label: f"--speculative-config '{cfg}'" for label, cfg in specs.items()}}
    cases = make_cases(args.cases)
    port = free_port()
    rounds: list[dict[str, dict]] = []
    for _ in range(args.rounds):
        results = {}
        for label, flags in configs.items():
            argv = serve_argv(f"--model {args.model} --max-model-len 4096 {flags}", port)
            with ManagedServer(argv, port, label) as server:
                results[label] = run(server.url, cases)
        rounds.append(results)
    print(f"{cpu()}, Python {platform.python_version()} (argparse.py), "
          f"{args.model}, {len(cases)} holes, {args.rounds} rounds")
    plain = rounds[0]["plain"]["outputs"]
    right = sum(o.startswith(c["hole"]) for o, c in zip(plain, cases))
    summary = {}
    for label in configs:
        best = max(r[label]["tok_s"] for r in rounds)
        ratios = [r[label]["tok_s"] / r["plain"]["tok_s"] for r in rounds]
        same = sum(o == p for r in rounds for o, p in zip(r[label]["outputs"], plain))
        summary[label] = {"tok_s": round(best, 2), "ratio": [round(x, 2) for x in ratios],
                          "identical": f"{same}/{len(cases) * len(rounds)}"}
        print(f"{label:>10}: {best:7.2f} tok/s  ratio to plain per round {summary[label]['ratio']}  "
              f"identical to plain {summary[label]['identical']}")
    print(f"fills that start with the removed lines: {right}/{len(cases)}")
    if args.markdown:
        rows = [f"| {label} | {v['tok_s']} | {', '.join(f'{x}x' for x in v['ratio'])} | {v['identical']} |"
                for label, v in summary.items()]
        with open(args.markdown, "w") as f:
            f.write("\n".join([f"{cpu()}, {args.model}, {len(cases)} holes, fills right {right}/{len(cases)}", "",
                               "| | decode tok/s | vs plain per round | identical to plain |",
                               "|---|---|---|---|", *rows]) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "right": right, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
