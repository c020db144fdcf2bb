"""The adaptive policy with and without the drift back to a sequence's slow estimate, on the same
drafts, without the machine's noise: qwen2.5-coder-1.5b with the 4-bit 32K-vocabulary 0.5b draft
(k <= 8) on every prompt of the code, math, prose and edit suites (128 tokens, greedy), in one
process. The cost tables (the target's per width, calibrated at start-up; the draft's per width,
from its warm-up and one prompt) are frozen before the first arm, so the policy's choices depend on
the drafts alone; each arm starts from the same prior. The modelled time of a request is the sum
of the frozen costs of the forwards it ran (target and draft, by width); its speedup is that of
plain decode (a one-row forward per token) over it. Both arms' tokens are compared.

    python results_final/slow_revert_1206/policy_sim.py > results_final/slow_revert_1206/policy_sim.txt
"""

import os
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import spec_decode as sd  # noqa: E402
from specserve.bench.suites import load_suites  # noqa: E402
from specserve.speculative import adaptive  # noqa: E402

SUITES = ("code", "math", "prose", "edit")


def counting(obj, widths: list) -> None:
    f = obj.forward

    def forward(batch, kv):
        widths.append(int(batch.input_ids.shape[0]))
        return f(batch, kv)

    obj.forward = forward


def main() -> None:
    eng = sd.fast_draft_engine()
    tok = eng.tokenizer
    prompts = sd.chat_prompts(tok, load_suites(",".join(SUITES), 100))
    sd.run_one(eng, prompts[0][2], 64)  # the draft's cost table sees every width it will use
    for cost in (eng.cost, eng.drafter.cost):
        cost.add = lambda *a, **k: None  # frozen from here
    print("target ms by width:", {w: round(t * 1e3, 1) for w, t in sorted(eng.cost.table.items())})
    print("draft ms by width:", {w: round(t * 1e3, 1) for w, t in sorted(eng.drafter.cost.table.items())})
    target, draft = [], []
    counting(eng.model, target)
    counting(eng.drafter.model, draft)
    prior, fpt, width = eng.policy.prior, eng.drafter.forwards_per_token, eng.drafter.width
    results = {}
    for arm, revert in (("without drift", 0.0), ("with drift", adaptive.IDLE_REVERT)):
        adaptive.IDLE_REVERT = revert
        eng.policy.prior, eng.drafter.forwards_per_token, eng.drafter.width = prior, fpt, width
        for suite, pid, ids in prompts:
            target.clear(), draft.clear()
            r = sd.run_one(eng, ids, 128)
            decode = target[1:]  # (the first: the prompt's prefill)
            t = sum(eng.cost.time(w) for w in decode) + sum(eng.drafter.cost.time(w) for w in draft)
            plain = (len(r["tokens"]) - 1) * eng.cost.time(1)
            results.setdefault(arm, []).append((suite, pid, plain / t, decode.count(1), r["tokens"]))
    same = sum(a[4] == b[4] for a, b in zip(*results.values()))
    print(f"same text in both arms: {same}/{len(prompts)}")
    for arm, rows in results.items():
        per = "; ".join(f"{s} {statistics.mean(x for u, _, x, _, _ in rows if u == s):.3f}x "
                        f"(lowest {min(x for u, _, x, _, _ in rows if u == s):.2f}x)" for s in SUITES)
        print(f"{arm}: {per}; all {statistics.mean(x for _, _, x, _, _ in rows):.3f}x; "
              f"one-row steps {sum(n for *_, n, _ in rows)}")
    print("per prompt (without / with, one-row steps):")
    for a, b in zip(*results.values()):
        print(f"  {a[0]}/{a[1]}: {a[2]:.2f}x {a[3]} / {b[2]:.2f}x {b[3]}")


if __name__ == "__main__":
    main()
