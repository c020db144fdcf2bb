"""Markdown table of `specserve bench --scenario needle` results (one JSON file per server).

    python benchmarks/needle_table.py results/needle_*.json
"""

from __future__ import annotations

import json
import re
import sys


def rows(path: str) -> list[str]:
    res = json.load(open(path))
    args = res["configs"][0].get("serve_args", "")
    model = re.search(r"--model (\S+)", args)
    dtype = re.search(r"--kv-cache-dtype (\S+)", args)
    out = []
    for r in res["scenarios"]["needle"][0]["rows"]:
        ttft = f"{r['ttft_s']:.1f} s" if r.get("ttft_s") else "-"
        answer = (r.get("answer") or r.get("error") or "").replace("|", "/").replace("\n", " ")[:60]
        out.append(f"| {model.group(1) if model else '?'} | {dtype.group(1) if dtype else 'auto'} | "
                   f"{r['prompt_tokens'] or r['target_tokens']:,} | {'yes' if r['found'] else 'NO'} | {ttft} | {answer} |")
    return out


def main(paths: list[str]) -> int:
    print("| model | KV dtype | prompt tokens | code found | TTFT | answer |")
    print("|---|---|---:|:---:|---:|---|")
    for p in paths:
        print("\n".join(rows(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
