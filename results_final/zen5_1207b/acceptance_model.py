"""Accepted drafts against what the policy's geometric model expected of them (2026-12-07, Zen 5).

qwen2.5-coder-1.5b with the 0.5b draft (q4_0, 32K draft vocabulary, k <= 5, adaptive); after one
short warm-up answer, three prompts each of code, math and prose, 128 tokens. For each drafting
step with k drafts at the sequence's estimate p, the model expects p + p^2 + ... + p^k accepted and
all k accepted with chance p^k; per prompt, those sums against what was accepted. Then over all
prompts, per draft position j: how often a draft at j was accepted once every draft before it was
(the model's p for each), against the mean estimate of those steps.

    python results_final/zen5_1207b/acceptance_model.py > results_final/zen5_1207b/acceptance_model.txt
"""
from policy_variants import sd
from specserve.bench.suites import load_suites

eng = sd.fast_draft_engine(k=sd.FAST_DRAFT["num_speculative_tokens"])
policy = eng.policy
steps = []  # (k drafted, the estimate it was chosen at, accepted)
chosen_at = {}
lengths, learn = policy.lengths, policy.learn


def traced_lengths(seqs, limits, extra_width=0):
    ks = lengths(seqs, limits, extra_width)
    chosen_at.update((id(s), s.accept_ema) for s in seqs)
    return ks


def traced_learn(seq, drafted, accepted, cut=False):
    if drafted:
        steps.append((drafted, chosen_at[id(seq)], accepted))
    return learn(seq, drafted, accepted, cut)


policy.lengths, policy.learn = traced_lengths, traced_learn
prompts = sd.chat_prompts(eng.tokenizer, load_suites("code,math,prose", 3))
sd.run_one(eng, prompts[0][2], 8)
every_step = []
for suite, pid, ids in prompts:
    steps.clear()
    sd.run_one(eng, ids, 128)
    expected = sum(sum(p ** j for j in range(1, k + 1)) for k, p, _ in steps)
    every = sum(1 for k, _, a in steps if a == k)
    print(f"{pid}: {len(steps)} drafting steps, accepted {sum(a for _, _, a in steps)} vs expected {expected:.1f}; "
          f"all accepted {every} vs expected {sum(p ** k for k, p, _ in steps):.1f}")
    every_step += steps
for j in range(1, max(k for k, _, _ in every_step) + 1):
    reached = [(p, a) for k, p, a in every_step if k >= j and a >= j - 1]
    if reached:
        kept = sum(a >= j for _, a in reached) / len(reached)
        print(f"position {j}: reached {len(reached)} times, accepted {kept:.2f}"
              f" of them, mean estimate {sum(p for p, _ in reached) / len(reached):.2f}")
