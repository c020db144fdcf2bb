"""Quality of each run-time weight format: perplexity on a fixed text, agreement with fp32.

    python benchmarks/weight_quality.py [--models smollm2-135m,qwen2.5-coder-1.5b]
        [--formats none,int8,q4,q4_0] [--tokens 1024] [--out q.json] [--markdown q.md]

The fixed text is the CPython LICENSE.txt that ships with the interpreter (English prose, the same
bytes for every run of one Python version), tokenized by the model and cut to --tokens tokens. One
teacher-forced forward per format (prefill in chunks of 256 over the paged KV cache) gives the
next-token logits at every position:
  perplexity  = exp(mean negative log-likelihood of the text's next tokens);
  top-1 agree = share of positions where the format's argmax equals fp32's (`none`), i.e. the
                greedy choice agreement with fp32 under the same context;
  logit diff  = relative L2 distance of the logits to fp32's, averaged over positions.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from specserve.engine.builder import set_threads  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402
from specserve.engine.model_runner import BatchEntry, build_forward_batch  # noqa: E402
from specserve.models.transformer import KVCache  # noqa: E402

BLOCK, CHUNK = 16, 256


def fixed_text() -> str:
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    return path.read_text(encoding="utf-8")


def teacher_forced_logits(model, cfg, ids: list[int]) -> torch.Tensor:
    """[T, V] logits of every position of ids (prefilled in chunks, one sequence)."""
    n = len(ids)
    blocks = -(-n // BLOCK)
    kv = KVCache.allocate(cfg, blocks, BLOCK, torch.float32, model.device)
    out = []
    for s in range(0, n, CHUNK):
        chunk = ids[s:s + CHUNK]
        batch = build_forward_batch([BatchEntry(chunk, s, [list(range(blocks))])], BLOCK, blocks,
                                    list(range(len(chunk))), model.device)
        out.append(model.forward(batch, kv).logits)
    return torch.cat(out)


def measure(name: str, formats: list[str], tokens: int) -> list[dict]:
    ref = None
    rows = []
    for fmt in formats:
        m = load_model(name, LoadOptions("cpu", "auto", fmt))
        ids = m.tokenizer.encode(fixed_text())[:tokens + 1]
        logits = teacher_forced_logits(m.model, m.config, ids[:-1])  # [T, V]
        target = torch.tensor(ids[1:])
        nll = torch.nn.functional.cross_entropy(logits, target).item()
        row = {"model": name, "format": fmt, "tokens": len(target), "perplexity": math.exp(nll),
               "weights_mb": m.model.weight_bytes() / 2**20}
        if ref is None:
            ref = logits
        else:
            row["top1_agree"] = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            row["logit_rel_diff"] = ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()
        rows.append(row)
        print(f"{name} {fmt}: ppl {row['perplexity']:.3f}", file=sys.stderr, flush=True)
        del m, logits
        gc.collect()
    return rows


def markdown(rows: list[dict], tokens: int) -> str:
    lines = [f"Perplexity on CPython's LICENSE.txt ({tokens} tokens, teacher-forced) and agreement with fp32 "
             "(`none`) under the same context.", "",
             "| model | format | weights MB | perplexity | top-1 agreement with fp32 | logit rel. diff |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        agree = f"{100 * r['top1_agree']:.1f}%" if "top1_agree" in r else "(reference)"
        diff = f"{100 * r['logit_rel_diff']:.1f}%" if "logit_rel_diff" in r else "-"
        lines.append(f"| {r['model']} | {r['format']} | {r['weights_mb']:.0f} | {r['perplexity']:.3f} | {agree} | {diff} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--formats", default="none,int8,q4,q4_0", help="the first is the reference")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    set_threads(a.threads)
    rows = [r for name in a.models.split(",") for r in measure(name.strip(), a.formats.split(","), a.tokens)]
    md = markdown(rows, a.tokens)
    print(md)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
