"""A fresh engine's first request: a long prompt, a short answer (2026-12-07, Zen 5).

qwen2.5-coder-1.5b with the 0.5b draft (q4_0, 32K draft vocabulary, k <= 5, adaptive), a fresh engine
per trial; long-argparse (long.jsonl, 1,548 tokens) answered with TOKENS tokens. Per trial: decode
tok/s, drafted tokens, and the steps at which the catch-up rule first let the sequence draft (the
tokens it may still make, the draft's unread tokens then). Before the stale widths followed the one-
row time (``CostModel.ref``), the rule turned to "draft" a few steps in as one row grew dearer.

    python results_final/zen5_1207b/first_request.py [TRIALS] [TOKENS] > results_final/zen5_1207b/first_request.txt
"""
import sys

from policy_variants import long_messages, no_follow, sd

TRIALS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 64
STALE = len(sys.argv) > 3 and sys.argv[3] == "stale"  # the widths keep their own times (as before)
for trial in range(TRIALS):
    eng = sd.fast_draft_engine(k=sd.FAST_DRAFT["num_speculative_tokens"])
    if STALE:
        no_follow(eng.policy)
    ids = sd.chat_ids(eng.tokenizer, long_messages())
    rule, turned = eng.policy._pays_back, []

    def recorded(seq, left, cap):
        says = rule(seq, left, cap)
        if says and eng.drafter.unread(seq) > 256:
            turned.append((left, eng.drafter.unread(seq)))
        return says

    eng.policy._pays_back = recorded
    r = sd.run_one(eng, ids, TOKENS)
    print(f"trial {trial + 1}{' (stale widths)' if STALE else ''}: {r['decode_tps']:.1f} tok/s, "
          f"{r['spec']['draft_tokens']} drafted; the rule let it draft a catch-up at (tokens left, unread): "
          f"{turned[:1] or 'never'}", flush=True)
