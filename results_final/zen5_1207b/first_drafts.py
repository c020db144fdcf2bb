"""Whether a new engine learns that its draft is good (2026-12-07, Zen 5).

A fresh adaptive engine (qwen2.5-coder-1.5b, the 0.5b draft in q4_0 over a 32K draft vocabulary,
k <= 5), built N times per arm, alternating: "before" (the policy without the first steps'
exploring and without cost probes: a new engine starts at a 0.5 prior, and its start-up timing
decides whether it drafts at all; policy_variants.before, which since first_drafts.txt was taken
also turns off CostModel.ref), and "now". Each engine answers the same warm-up request
("Say hello.", 8 tokens) and then one code prompt (TOKENS tokens). Per engine: the start-up
one-row time and the (k+1)-row time, the draft tokens and accepted tokens of the code prompt, and
its decode tok/s; per arm: how many engines drafted fewer than TOKENS / 4 tokens there (stuck at k = 0).

    python results_final/zen5_1207b/first_drafts.py [N] [TOKENS] > results_final/zen5_1207b/first_drafts.txt
"""
import statistics
import sys

from policy_variants import before, sd
from specserve.bench.suites import load_suites

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 64
K = sd.FAST_DRAFT["num_speculative_tokens"]


def one(arm):
    eng = sd.fast_draft_engine(k=K, ctx=2048)
    if arm == "before":
        before(eng.policy)
    t1, tk = eng.cost.time(1), eng.cost.time(K + 1)
    [(_, _, code)] = sd.chat_prompts(eng.tokenizer, load_suites("code", 1))
    sd.warm_up(eng)
    r = sd.run_one(eng, code, TOKENS)
    spec = r.get("spec") or {"draft_tokens": 0, "accepted_tokens": 0}
    return dict(t1=t1, tk=tk, drafted=spec["draft_tokens"], accepted=spec["accepted_tokens"], tps=r["decode_tps"])


rows = {"before": [], "now": []}
for i in range(N):
    for arm in (("before", "now") if i % 2 == 0 else ("now", "before")):
        r = one(arm)
        rows[arm].append(r)
        print(f"{arm:6s} engine {i + 1}: start-up one row {r['t1'] * 1e3:.1f} ms, six rows {r['tk'] * 1e3:.1f} ms; "
              f"code prompt drafted {r['drafted']}, accepted {r['accepted']}, {r['tps']:.1f} tok/s", flush=True)
for arm, rs in rows.items():
    stuck = sum(r["drafted"] < TOKENS // 4 for r in rs)
    print(f"{arm}: {stuck} of {len(rs)} engines drafted fewer than {TOKENS // 4} tokens on the code prompt; median "
          f"{statistics.median(r['tps'] for r in rs):.1f} tok/s (min {min(r['tps'] for r in rs):.1f})")
