"""Long prompts with short answers and no max_tokens: the catch-up rule's horizon (2026-12-07, Zen 5).

qwen2.5-coder-1.5b plain, and with the 0.5b draft (q4_0, 32K draft vocabulary, k <= 5, adaptive,
draft_window 512) twice: as the engine runs it (a long prompt's catch-up weighed against the lengths
of the answers finished before it, paid once the answer has outrun the short ones where that is worth
more: ``AnswerLengths.draft_now``), and as before (against the request's budget, here the rest of an
8K context, since no request sets max_tokens but the explanations). Each prompt of
long.jsonl and long6k.jsonl (1.5-5K tokens of code) is asked five questions with one-word answers
and then its own "explain" / "summarize" question (at most 384 tokens); the question comes first,
so no two prompts share a prefix. Greedy, ending at EOS; the engines take turns in a rotating order;
each engine's answer history starts empty after its warm-up. Per request and engine: seconds of
prefill and of decode (the draft's catch-up happens at its first proposal, inside decode), tokens,
draft tokens, and whether the text equals plain's.

    python results_final/zen5_1207c/short_answers.py > results_final/zen5_1207c/short_answers.txt
    python results_final/zen5_1207c/short_answers.py mean > results_final/zen5_1207c/short_answers_mean.txt

With "mean", the first drafting engine weighs the catch-up against the mean of what the answers seen
made beyond the sequence's length, paying at once where that repays it (no waiting out the short
ones): the rule as first written, kept to show why it waits.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "zen5_1207b"))
from policy_variants import LONG, LONG6K, sd  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402

SHORT = ["What is the name of the first class defined in the code below? Reply with the name only.",
         "Does the code below import the re module? Reply yes or no.",
         "How many classes does the code below define? Reply with a number only.",
         "Which method in the code below takes the most lines? Reply with its name only.",
         "Is the code below written for Python 2 or Python 3? Reply with one word."]
LONG_TOKENS = 384
SPEC = dict(sd.FAST_DRAFT, adaptive=True)
NEW, OLD = "draft, answers' lengths", "draft, the budget (as before)"


def requests() -> list[tuple[str, str, list[dict], int | None]]:
    """(file id, kind, messages, max_tokens) in the order asked."""
    out = []
    for path in (LONG, LONG6K):
        for line in open(path):
            d = json.loads(line)
            text = d["messages"][0]["content"]
            instruction, _, code = text.partition("\n\n")
            out += [(d["id"], f"short {i + 1}", [{"role": "user", "content": f"{q}\n\n{code}"}], None)
                    for i, q in enumerate(SHORT)]
            out.append((d["id"], "explain", d["messages"], LONG_TOKENS))
    return out


def run(engine, ids: list[int], max_tokens: int | None) -> dict:
    room = engine.max_model_len - len(ids)  # what the server gives a chat request without max_tokens
    r = sd.run_one(engine, ids, 0, SamplingParams(max_tokens=max_tokens or room))
    return {"tokens": r["tokens"], "prefill": r["prefill_s"], "decode": r["decode_s"],
            "drafted": (r.get("spec") or {}).get("draft_tokens", 0)}


engines = sd.make_engines("qwen2.5-coder-1.5b", [("plain", None), (NEW, SPEC), (OLD, SPEC)],
                          argparse.Namespace(quantization="auto", ctx=8192, threads=None))
engines[OLD].policy.answers.draft_now = lambda made, left, saving, cost: saving * left > cost
MEAN = len(sys.argv) > 1 and sys.argv[1] == "mean"
if MEAN:
    mine = engines[NEW].policy.answers
    mine.draft_now = lambda made, left, saving, cost: saving * statistics.mean(mine.rest(made, left)) > cost
tok = next(iter(engines.values())).tokenizer
for eng in engines.values():
    sd.warm_up(eng)
    eng.policy.answers.seen.clear()
names = list(engines)
rows = []
for i, (fid, kind, messages, max_tokens) in enumerate(requests()):
    ids = sd.chat_ids(tok, messages)
    k = i % len(names)
    res = {n: run(engines[n], ids, max_tokens) for n in names[k:] + names[:k]}
    for n in names:
        r = res[n]
        rows.append(dict(file=fid, kind=kind, config=n, prompt=len(ids), made=len(r["tokens"]), prefill=r["prefill"],
                         decode=r["decode"], drafted=r["drafted"], same=r["tokens"] == res["plain"]["tokens"]))
    print(f"{fid} {kind} ({len(ids)} tokens, {len(res['plain']['tokens'])} made): " + "  ".join(
        f"{n}={res[n]['decode']:.2f}s/{res[n]['drafted']}d" for n in names), file=sys.stderr, flush=True)

print("Seconds per request (prefill + decode; decode includes the draft's catch-up), tokens made, "
      "draft tokens; ratio = this engine's seconds over plain's.\n")
print("| prompt | question | prompt tokens | tokens made | plain s | " + " | ".join(names[1:]) + " |")
print("|---|---|---|---|---|" + "---|" * (len(names) - 1))
for i in range(0, len(rows), len(names)):
    g = rows[i:i + len(names)]
    p = g[0]["prefill"] + g[0]["decode"]
    print(f"| {g[0]['file']} | {g[0]['kind']} | {g[0]['prompt']} | {g[0]['made']} | {p:.2f} | " + " | ".join(
        f"{r['prefill'] + r['decode']:.2f} ({(r['prefill'] + r['decode']) / p:.2f}x, {r['drafted']} drafted)"
        f"{'' if r['same'] else ' differs'}" for r in g[1:]) + " |")
print("\nTotals (seconds, ratio to plain; decode = decode time alone):\n")
print("| configuration | short: prefill + decode | short: decode | explain: prefill + decode | explain: decode "
      "| requests that drafted | same text |")
print("|---|---|---|---|---|---|---|")
tot = {}
for n in names:
    mine = [r for r in rows if r["config"] == n]
    cell = []
    for kinds in (lambda k: k != "explain", lambda k: k == "explain"):
        sel = [r for r in mine if kinds(r["kind"])]
        cell += [sum(r["prefill"] + r["decode"] for r in sel), sum(r["decode"] for r in sel)]
    tot[n] = cell
    base = tot["plain"]
    print(f"| {n} | " + " | ".join(f"{c:.2f} ({c / b:.2f}x)" for c, b in zip(cell, base))
          + f" | {sum(r['drafted'] > 0 for r in mine)}/{len(mine)} | {sum(r['same'] for r in mine)}/{len(mine)} |")
json.dump(rows, open(os.path.join(HERE, "short_answers_mean.json" if MEAN else "short_answers.json"), "w"),
          indent=1)
