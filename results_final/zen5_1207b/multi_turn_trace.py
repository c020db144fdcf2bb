"""Each slide of a windowed draft over one long conversation (2026-12-07, Zen 5).

qwen2.5-coder-1.5b with the 0.5b draft (q4_0, 32K draft vocabulary, k <= 5, adaptive, draft_window
512), one engine; after a short warm-up request, long-argparse (long.jsonl) as a four-turn
conversation ("Go on." after each 128-token answer). Per slide: the sequence's length, the skip
chosen, the view's tokens and how many of them the prefix cache held (what the draft did not
re-read); per turn, how much of the new prompt is the last prompt and answer, and its drafting.

    python results_final/zen5_1207b/multi_turn_trace.py > results_final/zen5_1207b/multi_turn_trace.txt
"""
from policy_variants import long_messages, sd

eng = sd.fast_draft_engine(k=sd.FAST_DRAFT["num_speculative_tokens"], ctx=8192)
d = eng.drafter
slide = d._slide


def traced(seq, st):
    slide(seq, st)
    print(f"  slide at {seq.num_tokens} tokens: skip {st.skip}, view {seq.num_tokens - st.skip} tokens, "
          f"{st.num_computed} of them cached, {seq.num_tokens - st.skip - st.num_computed} read", flush=True)


d._slide = traced
tok = eng.tokenizer
sd.warm_up(eng)
messages = long_messages()
prev = []
for turn in range(4):
    ids = sd.chat_ids(tok, messages)
    same = next((i for i, (a, b) in enumerate(zip(prev, ids)) if a != b), min(len(prev), len(ids)))
    print(f"turn {turn + 1}: prompt {len(ids)} tokens, the first {same} the last turn's prompt and answer")
    r = sd.run_one(eng, ids, 128)
    spec = r["spec"]
    print(f"  {r['decode_tps']:.1f} tok/s, {spec['draft_tokens']} drafted, {spec['accepted_tokens']} accepted")
    prev = ids + r["tokens"]
    messages += [{"role": "assistant", "content": tok.decode(r["tokens"])}, {"role": "user", "content": "Go on."}]
