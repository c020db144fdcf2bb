"""Structured outputs: the grammar's cost per token, and decode speed with and without a schema,
with and without speculation; the whole case set (50 JSON schemas, 20 regexes) checked.

    python benchmarks/structured.py [--model smollm2-135m] [--drafters ngram,draft_model,dflash]
        [--max-tokens 96] [--max-num-seqs 8] [--every 1] [--http] [--out structured.json]

(draft_model: smollm2-135m in int8 for smollm2-135m, qwen2.5-coder-0.5b as stored for
qwen2.5-coder-1.5b.) --http runs the cases through a real server instead, once streamed and once
not, per drafter: every output must validate, both must be the same text, and equal the text
without a drafter.

For each configuration (no drafter, then each drafter) the cases of specserve.bench.structured_cases
run greedy on the engine, batched --max-num-seqs at a time, once constrained by their schema or
regex and once free (the same prompts). Reported: generated tokens, wall seconds, tokens per
second; for the constrained runs also how many outputs match (jsonschema / re.fullmatch) and
whether each drafter's tokens equal those without speculation (greedy: they must).

The mask cost per token is measured apart from the model: each constrained output (from the run
without a drafter) is replayed through a fresh grammar state, timing per token the mask of the
next token (llguidance's computation plus the unpacking to a [vocab] bool tensor) and the commit
of the token, as the engine does at each decode step. Compile times per schema are reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specserve.bench.structured_cases import cases, run_cases, valid  # noqa: E402
from specserve.commands.args import add_engine_args  # noqa: E402
from specserve.engine.builder import build_engine  # noqa: E402
from specserve.engine.constraint import Constraint, ConstraintSpec  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.server.structured import build_tokenizer, compile_grammar, grammar_source  # noqa: E402

SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3},
    "draft_model": {"method": "draft_model", "model": "smollm2-135m", "quantization": "int8",
                    "num_speculative_tokens": 4, "adaptive": False},
    "dflash": {"method": "dflash", "model": "smollm2-135m-dflash", "num_speculative_tokens": 7, "adaptive": False},
}


# the draft model of each target family (a draft must share the target's tokenizer)
DRAFT_FOR = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def spec_for(name: str, target: str) -> dict | None:
    spec = SPECS.get(name)
    if spec and name == "draft_model" and target in DRAFT_FOR:
        spec = {**spec, "model": DRAFT_FOR[target], "quantization": "auto"}
    return spec


def engine_for(model: str, max_num_seqs: int, spec: dict | None):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--model", model, "--max-num-seqs", str(max_num_seqs)]
    if spec:
        argv += ["--speculative-config", json.dumps(spec)]
    return build_engine(p.parse_args(argv))


def timed(engine, lltok, todo, params, constrained: bool):
    t0 = time.perf_counter()
    out = run_cases(engine, lltok, todo, params, constrained)
    return out, time.perf_counter() - t0


def mask_cost(lltok, todo, outputs, vocab: int) -> dict:
    """Per-token seconds of mask + commit, replaying the constrained outputs."""
    per_token = []
    for (kind, _name, _prompt, value), (toks, _finish) in zip(todo, outputs):
        c = Constraint(ConstraintSpec(compile_grammar(lltok, grammar_source(kind, value).grammar)))
        for t in toks:
            t0 = time.perf_counter()
            c.mask_after([], vocab)
            c.commit([t])
            per_token.append(time.perf_counter() - t0)
    per_token.sort()
    return {"tokens": len(per_token), "mean_us": 1e6 * statistics.fmean(per_token),
            "p50_us": 1e6 * per_token[len(per_token) // 2], "p99_us": 1e6 * per_token[int(len(per_token) * 0.99)]}


def compile_times(lltok, todo) -> dict:
    times = []
    for kind, _name, _prompt, value in todo:
        t0 = time.perf_counter()
        compile_grammar(lltok, grammar_source(kind, value).grammar)
        times.append(time.perf_counter() - t0)
    return {"mean_ms": 1e3 * statistics.fmean(times), "max_ms": 1e3 * max(times)}


def http_check(model: str, drafter: str, todo, max_tokens: int, base: list[str] | None) -> dict:
    """The cases through a real server (``specserve serve``) with response_format / guided_regex,
    streamed and not: every output must validate, the two must be the same text, and (base: the
    texts without a drafter) speculation must not change it."""
    import httpx

    from specserve.bench.serverproc import ManagedServer, free_port, serve_argv

    spec = spec_for(drafter, model)
    port = free_port()
    args = f"--model {model} --max-num-seqs 1" + (f" --speculative-config '{json.dumps(spec)}'" if spec else "")
    srv = ManagedServer(serve_argv(args, port), port, drafter).start()
    ok_plain = ok_stream = same = 0
    texts = []
    try:
        for kind, _name, prompt, value in todo:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                    "max_tokens": max_tokens}
            if kind == "json":
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}
            else:
                body["guided_regex"] = value
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=600).json()
            text = r["choices"][0]["message"]["content"]
            parts = []
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**body, "stream": True},
                              timeout=600) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for ch in json.loads(line[6:])["choices"]:
                            parts.append(ch["delta"].get("content") or "")
            streamed = "".join(parts)
            ok_plain += valid(kind, value, text)
            ok_stream += valid(kind, value, streamed)
            same += text == streamed
            texts.append(text)
    finally:
        srv.stop()
    n = len(todo)
    eq = n if base is None else sum(a == b for a, b in zip(base, texts))
    print(f"| {drafter} (HTTP) | {ok_plain}/{n} | {ok_stream}/{n} | {same}/{n} | {eq}/{n} |", flush=True)
    return {"valid": ok_plain, "valid_streamed": ok_stream, "streamed_equal": same, "equal_to_no_drafter": eq,
            "cases": n, "texts": texts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafters", default="ngram,draft_model,dflash")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--every", type=int, default=1, help="run every n-th case (1: all 70)")
    ap.add_argument("--http", action="store_true",
                    help="instead: the cases through a specserve server, streamed and not, per drafter")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    todo = cases()[::args.every]
    if args.http:
        print("| drafter | valid | valid streamed | streamed text equal | equal to no drafter |\n"
              "|---|---|---|---|---|")
        report: dict[str, dict] = {}
        for name in ["none"] + [d for d in args.drafters.split(",") if d]:
            report[name] = http_check(args.model, name, todo, args.max_tokens, report.get("none", {}).get("texts"))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "http": report}, f, indent=1)
        return
    params = SamplingParams(max_tokens=args.max_tokens)
    rows, report = [], {"model": args.model, "cases": len(todo), "max_tokens": args.max_tokens,
                        "cpu": platform.processor() or platform.machine(), "configs": {}}
    base = None
    lltok = None
    for name in ["none"] + [d for d in args.drafters.split(",") if d]:
        engine = engine_for(args.model, args.max_num_seqs, spec_for(name, args.model))
        if lltok is None:
            lltok, _ = build_tokenizer(engine.tokenizer)
            report["compile"] = compile_times(lltok, todo)
        con, t_con = timed(engine, lltok, todo, params, True)
        free, t_free = timed(engine, lltok, todo, params, False)
        dec = engine.tokenizer.decode
        ok = sum(f == "stop" and valid(k, v, dec(t)) for (k, _, _, v), (t, f) in zip(todo, con))
        if base is None:
            base = con
            report["mask"] = mask_cost(lltok, todo, con, engine.target.config.vocab_size)
        same = sum(a[0] == b[0] for a, b in zip(base, con))
        n_con, n_free = sum(len(t) for t, _ in con), sum(len(t) for t, _ in free)
        entry = {"constrained": {"tokens": n_con, "seconds": t_con, "tok_s": n_con / t_con, "valid": ok,
                                 "equal_to_no_drafter": same},
                 "free": {"tokens": n_free, "seconds": t_free, "tok_s": n_free / t_free}}
        if engine.speculative:
            entry["acceptance_rate"] = engine.totals.acceptance_rate
        report["configs"][name] = entry
        rows.append(f"| {name} | {n_free / t_free:.1f} | {n_con / t_con:.1f} | {ok}/{len(todo)} | "
                    f"{same}/{len(todo)} |")
        print(rows[-1], flush=True)
        del engine
    m, c = report["mask"], report["compile"]
    print(f"\n{args.model}, {len(todo)} cases, max_tokens {args.max_tokens}, batch {args.max_num_seqs}")
    print("| drafter | tok/s free | tok/s with schema | outputs valid | tokens equal to no drafter |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nmask + commit per token: mean {m['mean_us']:.0f} us, p50 {m['p50_us']:.0f} us, "
          f"p99 {m['p99_us']:.0f} us ({m['tokens']} tokens); compile per grammar: mean {c['mean_ms']:.1f} ms, "
          f"max {c['max_ms']:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
