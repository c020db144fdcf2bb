"""The catch-up rule's estimate against what drafting saved (2026-12-07, Zen 5).

qwen2.5-coder-1.5b with its 0.5b draft (q4_0, 32K draft vocabulary, the default draft_window of 512
tokens), one engine, and the same target without speculation in a second one. A short code
prompt first (as a server's earlier requests: it sets the policy's prior acceptance), then each
long.jsonl prompt (chat template applied) answered with TOKENS tokens, plain and with drafting
forced on (the rule's answer recorded, not obeyed). Per prompt: what the rule estimated (the catch-up,
and the most drafting could save over the answer), and what was measured (the catch-up forward, and
the decode time saved apart from it).

    python results_final/zen5_1207/payback_estimate.py [TOKENS] > results_final/zen5_1207/payback_estimate.txt
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from engine_utils import chat_ids  # noqa: E402
from specserve.commands.args import add_engine_args  # noqa: E402
from specserve.engine.builder import build_engine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 128
LONG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "zen5_1206c", "long.jsonl")
spec = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 8, "quantization": "q4_0",
        "draft_vocab_size": 32768}


def engine(*extra):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return build_engine(p.parse_args(["--model", "qwen2.5-coder-1.5b", *extra]))


def decode_seconds(eng, ids, rid):
    """Seconds from the first token out to the last (the prefill excluded)."""
    first = None
    for o in eng.generate(ids, SamplingParams(max_tokens=TOKENS, ignore_eos=True), rid):
        if first is None and o.new_token_ids:
            first = time.perf_counter()
    return time.perf_counter() - first


drafting = engine("--speculative-config", json.dumps(spec))
plain = engine()
policy = drafting.policy
seen = []
rule = policy._pays_back


def recording(seq, left, cap):
    terms = policy.catch_up_terms(seq, cap)
    if terms is not None:
        seen.append(dict(cost=terms[0], per_token=terms[1], left=left, p=seq.accept_ema, plain=policy.cost.time(1),
                         says=rule(seq, left, cap)))
    return True  # drafting forced on


policy._pays_back = recording
warm = chat_ids(drafting, "Write a Python function that parses an ISO 8601 date without the datetime module.")
for eng in (drafting, plain):
    decode_seconds(eng, warm, f"warm-{id(eng)}")
print(f"prior acceptance after the warm-up request: {policy.prior:.2f}; answers of {TOKENS} tokens")
for i, line in enumerate(open(LONG)):
    ids = chat_ids(drafting, json.loads(line)["messages"][0]["content"])
    seen.clear()
    t_plain = decode_seconds(plain, ids, f"p{i}")
    t_draft = decode_seconds(drafting, ids, f"d{i}")
    caught = max(drafting.drafter.wide.values())[1]  # the latest widest forward: this prompt's catch-up
    est = seen[0]
    saved_est = est["left"] * (est["plain"] - est["per_token"])
    print(f"prompt of {len(ids)} tokens: rule said {'draft' if est['says'] else 'plain'} (p {est['p']:.2f}, one row "
          f"{est['plain'] * 1e3:.1f} ms, best per token {est['per_token'] * 1e3:.1f} ms); catch-up estimated "
          f"{est['cost']:.2f} s, measured {caught:.2f} s; saving estimated {saved_est:.2f} s, measured "
          f"{t_plain - (t_draft - caught):.2f} s (decode plain {t_plain:.2f} s, drafting {t_draft:.2f} s)")
