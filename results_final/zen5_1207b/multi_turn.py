"""A long conversation's later turns with a windowed draft model (2026-12-07, Zen 5).

qwen2.5-coder-1.5b plain, and with the 0.5b draft (q4_0, 32K draft vocabulary, k <= 5, adaptive,
draft_window 512) twice: as the engine runs it (a slide takes the skip whose view the prefix cache
holds, so a later turn reads what is new), and as before (every slide views exactly the last 512
tokens and reads them all). Each prompt of long.jsonl and long6k.jsonl (1.5-5K tokens of code)
starts a conversation of three turns: the prompt, then two follow-up requests, each turn's history
holding the plain engine's answer (all engines get the same prompts, rendered by the chat template).
Answers of TOKENS tokens, greedy, EOS ignored; the engines take turns in a rotating order. Decode
tok/s counts the draft's catch-up (it happens at the first proposal, inside decode). Per turn and
engine: decode tok/s, ratio to plain, the draft tokens and whether the text equals plain's.

    python results_final/zen5_1207b/multi_turn.py [TOKENS] > results_final/zen5_1207b/multi_turn.txt
    python results_final/zen5_1207b/multi_turn.py TOKENS gaps > results_final/zen5_1207b/multi_turn_gaps.txt

With "gaps", the second drafting engine is the first without the steps' gaps (the policy prices a
step at its forwards' time alone) instead of the one viewing anew at each slide: multi_turn_gaps.txt
was taken with step_gaps.patch applied (not kept; without it both engines are the same).
"""
import argparse
import json
import statistics
import sys

from policy_variants import LONG, LONG6K, no_gaps, sd
from specserve.speculative.draft_model import SINK_TOKENS

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 128
FILES = [LONG, LONG6K]
FOLLOW_UPS = ["Now add a short docstring to each class you described, and show only those classes.",
              "Which of these classes would you test first, and how? Write the first test."]
SPEC = dict(sd.FAST_DRAFT, adaptive=True)
GAPS = len(sys.argv) > 2 and sys.argv[2] == "gaps"
REUSE = "draft, views reused"
BEFORE = "draft, views reused, no step gaps" if GAPS else "draft, a new view each slide (as before)"


def as_before(eng):
    d = eng.drafter
    d._plan = lambda seq, st: (seq.num_tokens - SINK_TOKENS - d.window, 0)


engines = sd.make_engines("qwen2.5-coder-1.5b", [("plain", None), (REUSE, SPEC), (BEFORE, SPEC)],
                          argparse.Namespace(quantization="auto", ctx=8192, threads=None))
if GAPS:
    no_gaps(engines[BEFORE].policy)
else:
    as_before(engines[BEFORE])
tok = next(iter(engines.values())).tokenizer
for eng in engines.values():
    sd.warm_up(eng)
names = list(engines)
rows = []
convs = [json.loads(line) for f in FILES for line in open(f)]
for ci, conv in enumerate(convs):
    messages = list(conv["messages"])
    for turn in range(1 + len(FOLLOW_UPS)):
        ids = sd.chat_ids(tok, messages)
        k = (ci + turn) % len(names)
        res = {n: sd.run_one(engines[n], ids, TOKENS) for n in names[k:] + names[:k]}
        for n in names:
            r = res[n]
            rows.append(dict(conv=conv["id"], turn=turn + 1, config=n, prompt=len(ids), tps=r["decode_tps"],
                             ratio=r["decode_tps"] / res["plain"]["decode_tps"],
                             drafted=(r.get("spec") or {}).get("draft_tokens", 0),
                             same=r["tokens"] == res["plain"]["tokens"]))
        print(f"{conv['id']} turn {turn + 1} ({len(ids)} tokens): " + "  ".join(
            f"{n}={res[n]['decode_tps']:.1f}" for n in names), file=sys.stderr, flush=True)
        if turn < len(FOLLOW_UPS):
            messages += [{"role": "assistant", "content": tok.decode(res["plain"]["tokens"])},
                         {"role": "user", "content": FOLLOW_UPS[turn]}]
print(f"Decode tok/s over {TOKENS}-token answers, the draft's catch-up included; ratio to plain in the same turn.\n")
print("| conversation | turn | prompt tokens | plain | " + " | ".join(names[1:]) + " |")
print("|---|---|---|---|" + "---|" * (len(names) - 1))
for i in range(0, len(rows), len(names)):
    g = rows[i:i + len(names)]
    print(f"| {g[0]['conv']} | {g[0]['turn']} | {g[0]['prompt']} | {g[0]['tps']:.1f} | " + " | ".join(
        f"{r['tps']:.1f} ({r['ratio']:.2f}x){'' if r['same'] else ' differs'}" for r in g[1:]) + " |")
for n in names[1:]:
    for label, turns in (("turn 1", {1}), ("turns 2-3", {2, 3})):
        rs = [r for r in rows if r["config"] == n and r["turn"] in turns]
        print(f"{n}, {label}: median ratio {statistics.median(r['ratio'] for r in rs):.2f}x over {len(rs)}; "
              f"same text {sum(r['same'] for r in rs)}/{len(rs)}")
