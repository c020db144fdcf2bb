"""The draft model's cost per drafted token without (0) and with (3) prompt lookup's guesses, fixed k = 4,
qwen2.5-coder-1.5b with the 4-bit 32K draft, the same prompts alternating (2 per suite, 96 tokens, two rounds).

    python results_final/draft_lookup_1206/draft_cost.py [math,prose]
"""
import sys, time, argparse
import os
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
sys.path.insert(0, os.path.join(ROOT, 'benchmarks')); sys.path.insert(0, ROOT)
import spec_decode as sd
from specserve.bench.suites import load_suites
D = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4, "quantization": "q4_0",
     "draft_vocab_size": 32768, "adaptive": False}
cfgs = [("l0", dict(D, draft_lookup_tokens=0)), ("l3", dict(D, draft_lookup_tokens=3))]
engs = sd.make_engines("qwen2.5-coder-1.5b", cfgs, argparse.Namespace(quantization="auto", ctx=4096, threads=None))
tok = engs["l0"].tokenizer
prompts = sd.chat_prompts(tok, load_suites(sys.argv[1] if len(sys.argv) > 1 else "math,prose", 2))
acc = {n: [0.0, 0, 0, 0.0] for n in engs}  # propose seconds, drafted, forwards, total decode s
for n, e in engs.items():
    d = e.drafter
    real = d.propose
    def timed(seqs, ks, real=real, n=n, d=d):
        t = time.perf_counter(); out = real(seqs, ks); acc[n][0] += time.perf_counter() - t
        return out
    d.propose = timed
    sd.run_one(e, prompts[0][2], 8)
acc = {n: [0.0, 0, 0, 0.0] for n in engs}
for rnd in range(2):
    for suite, pid, ids in prompts:
        for n, e in (engs.items() if rnd == 0 else reversed(list(engs.items()))):
            d = e.drafter; f0, t0 = d.num_forwards, d.num_drafted
            r = sd.run_one(e, ids, 96)
            acc[n][1] += d.num_drafted - t0; acc[n][2] += d.num_forwards - f0; acc[n][3] += r["decode_s"]
for n, (s, dr, fw, dec) in acc.items():
    print(f"{n}: {1e3 * s / dr:.2f} ms of drafting per drafted token, {fw / dr:.2f} forwards per token, "
          f"{1e3 * s / fw:.2f} ms per forward, drafting {100 * s / dec:.0f}% of decode time, decode {dec:.1f} s")
