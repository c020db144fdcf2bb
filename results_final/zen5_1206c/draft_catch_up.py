"""What a draft model's catch-up on a long prompt costs, and what the policy does with it (2026-12-06, Zen 5).

qwen2.5-coder-1.5b with its 0.5b draft (q4_0, 32K draft vocabulary, as native_llamacpp.py's "specserve
draft q4_0 32K"): the draft's cost table after start-up and its record of wide forwards (the 512-row warm-up), the
policy's estimate of the catch-up on each long.jsonl prompt, then the draft model made to read each
prompt (one proposal of one token, timed), and each prompt answered (128 tokens) with the number of
draft forwards the answer took.

    python results_final/zen5_1206c/draft_catch_up.py > results_final/zen5_1206c/draft_catch_up.txt

(The draft reads whole prompts: draft_window 0, the behaviour when this ran; since 2026-12-07 the
default reads a window of them.) With JSONL files as arguments, their prompts instead of long.jsonl, and
a context of 8192 (results_final/zen5_1207/draft_catch_up.txt).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from specserve.commands.args import add_engine_args  # noqa: E402
from specserve.engine.builder import build_engine  # noqa: E402
from specserve.engine.sequence import Sequence  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402

D = os.path.dirname(os.path.abspath(__file__))
spec = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 8, "quantization": "q4_0",
        "draft_vocab_size": 32768, "draft_window": 0}
FILES = sys.argv[1:] or [os.path.join(D, "long.jsonl")]
p = argparse.ArgumentParser()
add_engine_args(p)
engine = build_engine(p.parse_args(["--model", "qwen2.5-coder-1.5b", "--speculative-config", json.dumps(spec)]
                                   + (["--max-model-len", "8192"] if sys.argv[1:] else [])))
drafter = engine.drafter
ms = {k: round(v * 1e3, 1) for k, v in sorted(drafter.cost.table.items())}
wide = {r: round(t * 1e3, 1) for r, t in sorted(drafter.wide.values())}
print(f"draft forward ms by rows after start-up: {ms}; wide forwards: {wide}")
for i, line in enumerate(ln for f in FILES for ln in open(f)):
    ids = engine.tokenizer.encode(json.loads(line)["messages"][0]["content"])  # the text alone, no chat template
    n = len(ids)
    est = drafter.catch_up_cost(n)
    seq = Sequence(f"c{i}", ids, SamplingParams(max_tokens=8, ignore_eos=True), None)
    t0 = time.perf_counter()
    drafter.propose([seq], [1])
    took = time.perf_counter() - t0
    drafter.on_finished(seq)
    before = drafter.num_forwards
    t0 = time.perf_counter()
    out = [t for o in engine.generate(ids, SamplingParams(max_tokens=128, ignore_eos=True), f"g{i}")
           for t in o.new_token_ids]
    print(f"prompt of {n} tokens: catch-up estimated {est:.2f} s, measured {took:.2f} s; 128 tokens answered in "
          f"{time.perf_counter() - t0:.2f} s with {drafter.num_forwards - before} draft forwards ({len(out)} tokens)")
