"""KV cache dtypes: memory per token and greedy agreement with the fp32 cache.

    python benchmarks/kv_dtypes.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--dtypes fp32,bf16,...]
        [--tokens 256] [--prompts-per-suite 2] [--quantization auto] [--out FILE.json] [--markdown FILE.md]

For every model and --kv-cache-dtype:
  * bytes per token (exact, scales included) and the tokens a 1 GiB pool holds;
  * free-running greedy decoding of --tokens tokens on the built-in bench prompts (code, math, prose;
    chat template applied), compared with the same decoding over an fp32 cache: tokens until the
    first difference (mean and minimum over prompts; --tokens means "never differed") and the fraction of
    positions with the same token;
  * teacher-forced top-1 agreement: the fp32 run's text is fed through the model with the dtype's
    cache in one prefill, and the argmax at each position is compared with the fp32 run's next token.
    Unlike the free-running numbers this does not snowball after a first difference.
The fp32 row is a self-check (it must be 100% everywhere: prefill and decode are bit-identical).
Weights use the same run-time format for every dtype (--quantization, default: the CPU default),
so only the KV cache differs between rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from specserve.engine.builder import set_threads  # noqa: E402
from specserve.engine.config import kv_bytes_per_token  # noqa: E402
from specserve.models.chat_template import ChatTemplate  # noqa: E402
from specserve.models.kv_cache import KV_DTYPES, KVCache  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402
from specserve.server.fingerprint import weight_formats  # noqa: E402
from specserve.engine.model_runner import BatchEntry, build_forward_batch  # noqa: E402

BLOCK = 16
GiB = 1 << 30
PROMPTS = Path(__file__).resolve().parent.parent / "specserve" / "bench" / "prompts"


def bench_texts(per_suite: int) -> list[str]:
    out = []
    for suite in ("code", "math", "prose"):
        for line in (PROMPTS / f"{suite}.jsonl").read_text().splitlines()[:per_suite]:
            obj = json.loads(line)
            out.append(obj["messages"][-1]["content"] if "messages" in obj else obj["prompt"])
    return out


class Runner:
    """Greedy decoding of S sequences together through a paged cache of one dtype."""

    def __init__(self, lm, prompts: list[list[int]], n_new: int, kv_dtype: str):
        self.lm, self.prompts, self.n_new = lm, prompts, n_new
        self.bps = -(-(max(map(len, prompts)) + n_new + 1) // BLOCK)
        self.kv = KVCache.allocate(lm.config, len(prompts) * self.bps, BLOCK, kv_dtype, "cpu")
        self.tables = torch.arange(len(prompts) * self.bps, dtype=torch.int32).view(len(prompts), self.bps)

    def forward(self, rows: list[tuple[int, list[int], int]], logits_rows: list[int]) -> torch.Tensor:
        """rows: (seq, tokens, first position)."""
        entries = [BatchEntry(toks, p0, [self.tables[s].tolist()]) for s, toks, p0 in rows]
        batch = build_forward_batch(entries, BLOCK, self.bps, logits_rows, torch.device("cpu"))
        return self.lm.model.forward(batch, self.kv).logits

    def generate(self) -> list[list[int]]:
        outs: list[list[int]] = []
        for s, p in enumerate(self.prompts):  # prefill one prompt at a time
            outs.append([int(self.forward([(s, p, 0)], [len(p) - 1]).argmax(-1)[0])])
        for _ in range(self.n_new - 1):  # decode all sequences together
            rows = [(s, [o[-1]], len(p) + len(o) - 1) for s, (p, o) in enumerate(zip(self.prompts, outs))]
            nxt = self.forward(rows, list(range(len(rows)))).argmax(-1).tolist()
            for o, t in zip(outs, nxt):
                o.append(int(t))
        return outs

    def teacher_forced(self, refs: list[list[int]]) -> list[list[int]]:
        """Argmax after each prefix prompt + ref[:i], from one prefill per sequence."""
        out = []
        for s, (p, ref) in enumerate(zip(self.prompts, refs)):
            toks = p + ref[:-1]
            rows = list(range(len(p) - 1, len(toks)))
            out.append(self.forward([(s, toks, 0)], rows).argmax(-1).tolist())
        return out


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_model(name: str, a: argparse.Namespace) -> list[dict]:
    t0 = time.perf_counter()
    lm = load_model(name, LoadOptions("cpu", "auto", a.quantization))
    tok = lm.tokenizer
    tmpl = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    prompts = [tok.encode(tmpl.render([{"role": "user", "content": t}])) for t in bench_texts(a.prompts_per_suite)]
    fmt = ",".join(weight_formats(lm.model))
    print(f"{name}: loaded in {time.perf_counter() - t0:.1f}s (weights {fmt}), {len(prompts)} prompts", flush=True)
    ref = Runner(lm, prompts, a.tokens, "fp32").generate()
    rows = []
    for dtype in a.dtypes:
        t = time.perf_counter()
        runner = Runner(lm, prompts, a.tokens, dtype)
        got = ref if dtype == "fp32" and not a.check_fp32 else runner.generate()
        tf = Runner(lm, prompts, a.tokens, dtype).teacher_forced(ref)
        fd = [first_diff(r, g) for r, g in zip(ref, got)]
        same = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
        tf_same = sum(x == y for r, f in zip(ref, tf) for x, y in zip(r, f))
        total = sum(len(r) for r in ref)
        per_token = kv_bytes_per_token(lm.config, dtype)
        row = {"model": name, "weights": fmt, "kv_dtype": dtype, "bytes_per_token": per_token,
               "vs_fp32": per_token / kv_bytes_per_token(lm.config, "fp32"),
               "tokens_per_gib": GiB // per_token, "prompts": len(prompts), "tokens": a.tokens,
               "first_diff_mean": sum(fd) / len(fd), "first_diff_min": min(fd), "first_diff": fd,
               "identical_frac": same / total, "teacher_forced_agree": tf_same / total,
               "seconds": time.perf_counter() - t}
        rows.append(row)
        print(f"  {dtype:9s} {per_token:7d} B/tok  {row['tokens_per_gib']:8d} tok/GiB  first diff mean "
              f"{row['first_diff_mean']:6.1f} min {row['first_diff_min']:4d}  identical {row['identical_frac']:.3f}  "
              f"teacher-forced {row['teacher_forced_agree']:.3f}  ({row['seconds']:.0f}s)", flush=True)
    return rows


def markdown(rows: list[dict], a: argparse.Namespace) -> str:
    lines = [f"Greedy agreement with the fp32 KV cache over {a.tokens} tokens, {rows[0]['prompts']} bench prompts "
             f"({a.prompts_per_suite} per suite: code, math, prose), weights as loaded by default on CPU.", "",
             "| model | KV dtype | bytes/token | vs fp32 | tokens in 1 GiB | first diff (mean / min) "
             "| identical tokens | teacher-forced top-1 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kv_dtype']} | {r['bytes_per_token']:,} | {r['vs_fp32']:.3f} | "
                     f"{r['tokens_per_gib']:,} | {r['first_diff_mean']:.1f} / {r['first_diff_min']} | "
                     f"{100 * r['identical_frac']:.1f}% | {100 * r['teacher_forced_agree']:.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m")
    p.add_argument("--dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompts-per-suite", type=int, default=2)
    p.add_argument("--quantization", default="auto", help="weight format, the same for every KV dtype")
    p.add_argument("--check-fp32", action="store_true", help="also re-run the fp32 row (self-check)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--markdown", default=None, help="markdown table file")
    a = p.parse_args()
    a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    set_threads(a.threads)
    rows = []
    for name in a.models.split(","):
        rows += run_model(name.strip(), a)
    md = markdown(rows, a)
    print(md)
    if a.markdown:
        Path(a.markdown).write_text(md)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
