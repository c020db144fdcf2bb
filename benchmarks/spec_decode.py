"""Decode speed with and without each drafter, interleaved per prompt, as ratios vs plain greedy.

    python benchmarks/spec_decode.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--tokens 128]
        [--runs 3] [--suites code,math,prose,edit] [--prompts-per-suite 4] [--adaptive on|off|both]
        [--by-run] [--out spec.json] [--markdown spec.md]

For each model the target is loaded once and every configuration (plain greedy, ngram, draft
model...) gets its own engine around it (own KV pool, drafter, adaptive policy); then for
each run and prompt the configurations generate one after the other (order rotated per prompt),
greedy, ignoring EOS, exactly --tokens tokens. Decode tok/s = (tokens - 1) / (time from the first
token to the last), as `specserve generate` reports it. "speedup" is the median over (prompt, run)
of the paired ratio config / plain measured back to back; "identical" counts prompts whose tokens
equal plain greedy's. Suffix decoding keeps earlier outputs: from the second run on it has seen
every answer before (a repeated question); --by-run reports each run apart.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specserve.bench.suites import load_suites  # noqa: E402
from specserve.commands.args import add_engine_args  # noqa: E402
from specserve.engine.builder import set_threads  # noqa: E402
from specserve.engine.config import EngineConfig  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.models.chat_template import ChatTemplate  # noqa: E402
from specserve.models.loader import LoadOptions, load_model  # noqa: E402
from specserve.speculative.config import parse_speculative_config  # noqa: E402
from specserve.speculative.registry import build_drafter  # noqa: E402

# the 0.5b draft in 4 bits over a 32K-token draft vocabulary (README: "Draft model")
FAST_DRAFT = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5,
              "quantization": "q4_0", "draft_vocab_size": 32768}
# model -> drafters worth trying on it: (label, speculative config without "adaptive")
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
DFLASH = {"method": "dflash", "model": "smollm2-135m-dflash", "num_speculative_tokens": 7}
DRAFTERS = {
    "smollm2-135m": [("ngram", {"method": "ngram", "num_speculative_tokens": 8}),
                     ("suffix", SUFFIX),
                     ("dflash", DFLASH),
                     ("chain suffix+dflash", {"method": "chain", "num_speculative_tokens": 8,
                                              "drafters": [SUFFIX, DFLASH]})],
    "qwen2.5-coder-1.5b": [
        ("ngram", {"method": "ngram", "num_speculative_tokens": 8}),
        ("suffix", SUFFIX),
        ("draft 0.5b", {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5}),
        ("draft 0.5b q4_0 32K", FAST_DRAFT),
        ("chain suffix+draft", {"method": "chain", "num_speculative_tokens": 8, "drafters": [SUFFIX, FAST_DRAFT]}),
    ],
}
DEFAULT_DRAFTERS = [("ngram", {"method": "ngram", "num_speculative_tokens": 8})]


def make_engines(model: str, cfgs: list[tuple[str, dict | None]], a: argparse.Namespace) -> dict:
    """One engine per configuration, all sharing ONE loaded target model (what build_engine does,
    minus reloading the target per engine): each engine has its own KV pool, drafter and policy."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--model", model, "--quantization", a.quantization, "--max-num-seqs", "1", "--max-model-len", str(a.ctx)]
    args = p.parse_args(argv + (["--threads", str(a.threads)] if a.threads else []))
    set_threads(args.threads)
    options = LoadOptions(args.device, args.dtype, args.quantization)
    ecfg = EngineConfig.from_args(args)
    t = time.perf_counter()
    target = load_model(model, options)
    print(f"[{model}] loaded in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
    max_len = min(ecfg.max_model_len or target.config.max_position, target.config.max_position)
    engines = {}
    for name, spec_dict in cfgs:
        spec = parse_speculative_config(spec_dict)
        engines[name] = LLMEngine(target, ecfg, spec, build_drafter(spec, target, options, ecfg, max_len))
    return engines


_counter = itertools.count()


def run_one(engine, ids: list[int], tokens: int, params: SamplingParams | None = None) -> dict:
    """One request: ``tokens`` greedy tokens with EOS ignored, or as ``params`` say."""
    out, last = [], None
    drafter = engine.drafter
    before = (getattr(drafter, "num_forwards", 0), getattr(drafter, "num_drafted", 0))
    params = params or SamplingParams(max_tokens=tokens, ignore_eos=True)
    for o in engine.generate(ids, params, request_id=f"bench-{next(_counter)}"):
        out += o.new_token_ids
        last = o
    n = len(out)
    dec = max(last.decode_time, 1e-9)
    r = {"tokens": out, "decode_tps": (n - 1) / dec if n > 1 else 0.0, "decode_s": last.decode_time,
         "prefill_s": last.prefill_time}
    if last.acceptance is not None:
        r["spec"] = {k: last.acceptance.to_dict()[k] for k in ("steps", "draft_tokens", "accepted_tokens")}
        if hasattr(drafter, "num_forwards"):  # a draft model: its forwards, and the tokens they drafted
            r["spec"]["draft_forwards"] = drafter.num_forwards - before[0]
            r["spec"]["model_drafted"] = drafter.num_drafted - before[1]
    return r


def configs_for(model: str, a: argparse.Namespace) -> list[tuple[str, dict | None]]:
    drafters = DRAFTERS.get(model, DEFAULT_DRAFTERS)
    if a.spec:  # --spec LABEL=JSON (repeatable) replaces the built-in list
        drafters = [(lab, json.loads(js)) for lab, _, js in (x.partition("=") for x in a.spec)]
    if a.drafters:
        drafters = [d for d in drafters if d[0].split()[0] in a.drafters.split(",")]
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.adaptive]
    out: list[tuple[str, dict | None]] = [("plain", None)]
    for label, spec in drafters:
        for ad in modes:
            name = label + ("" if a.adaptive != "both" else (" adaptive" if ad else " fixed-k"))
            out.append((name, dict(spec, adaptive=ad)))
    return out


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """Chat messages rendered by the model's chat template, as token ids."""
    ct = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    return tok.encode(ct.render(messages), add_special_tokens=False)


def chat_prompts(tok, suites: dict) -> list[tuple[str, str, list[int]]]:
    """(suite, prompt id, the prompt's ids rendered by the model's chat template) for every prompt."""
    return [(s, p.id, chat_ids(tok, p.as_messages())) for s, ps in suites.items() for p in ps]


def warm_up(engine) -> None:
    """One short request on no suite prompt: first-call costs stay out of the numbers."""
    run_one(engine, chat_ids(engine.tokenizer, [{"role": "user", "content": "Say hello."}]), 8)


def fast_draft_engine(model: str = "qwen2.5-coder-1.5b", k: int = 8, ctx: int = 4096):
    """One adaptive engine with the 4-bit 32K-vocabulary draft (k <= ``k``), for the profiles in
    results_final/ that look inside a step."""
    spec = dict(FAST_DRAFT, num_speculative_tokens=k, adaptive=True)
    return make_engines(model, [("d", spec)], argparse.Namespace(quantization="auto", ctx=ctx, threads=None))["d"]


def bench_model(model: str, a: argparse.Namespace, suites: dict, adjust=None) -> list[dict]:
    """adjust: called with the engines by name before the first request (a script's variant of one)."""
    cfgs = configs_for(model, a)
    engines = make_engines(model, cfgs, a)
    if adjust is not None:
        adjust(engines)
    tok = next(iter(engines.values())).tokenizer
    prompts = chat_prompts(tok, suites)
    for eng in engines.values():
        warm_up(eng)
    rows = []  # one per (config, prompt, run)
    for run in range(a.runs):
        for pi, (suite, pid, ids) in enumerate(prompts):
            k = (pi + run) % len(cfgs)
            order = cfgs[k:] + cfgs[:k]
            res = {name: run_one(engines[name], ids, a.tokens) for name, _ in order}
            for name, _ in cfgs:
                r = res[name]
                rows.append({"model": model, "config": name, "suite": suite, "prompt": pid, "run": run,
                             "decode_tps": r["decode_tps"], "ratio": r["decode_tps"] / res["plain"]["decode_tps"],
                             "identical": r["tokens"] == res["plain"]["tokens"], "spec": r.get("spec")})
            print(f"[{model}] run {run + 1}/{a.runs} {pid}: " + "  ".join(
                f"{n}={res[n]['decode_tps']:.1f}" for n, _ in cfgs), file=sys.stderr, flush=True)
    engines.clear()
    gc.collect()
    return rows


def summarize(rows: list[dict], by_run: bool = False) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        tag = f" #{r['run'] + 1}" if by_run else ""
        groups.setdefault((r["model"], r["config"], r["suite"] + tag), []).append(r)
        groups.setdefault((r["model"], r["config"], "all" + tag), []).append(r)
    out = []
    for (model, cfg, suite), rs in groups.items():
        tps = [r["decode_tps"] for r in rs]
        steps = sum(r["spec"]["steps"] for r in rs if r["spec"])
        drafted = sum(r["spec"]["draft_tokens"] for r in rs if r["spec"])
        acc = sum(r["spec"]["accepted_tokens"] for r in rs if r["spec"])
        fwd = sum(r["spec"].get("draft_forwards", 0) for r in rs if r["spec"])
        model_drafted = sum(r["spec"].get("model_drafted", 0) for r in rs if r["spec"])
        prompts = {r["prompt"] for r in rs}
        same = {p for p in prompts if all(r["identical"] for r in rs if r["prompt"] == p)}
        out.append({"model": model, "config": cfg, "suite": suite, "n": len(rs),
                    "decode_tps_median": statistics.median(tps), "decode_tps_min": min(tps),
                    "decode_tps_max": max(tps), "speedup_median": statistics.median(r["ratio"] for r in rs),
                    "acceptance_rate": acc / drafted if drafted else None,
                    "mean_acceptance_length": (acc + steps) / steps if steps else None,
                    "draft_forwards_per_token": fwd / model_drafted if model_drafted else None,
                    "identical": f"{len(same)}/{len(prompts)}"})
    first = {}
    for r in rows:
        for key in (r["model"], r["config"], r["suite"]):
            first.setdefault(key, len(first))
    first["all"] = len(first)

    def order(s: dict) -> tuple:
        suite, _, run = s["suite"].partition(" #")  # by run: each suite's runs in turn
        return first[s["model"]], first[suite], int(run or 0), first[s["config"]]
    return sorted(out, key=order)


def markdown(summary: list[dict], a: argparse.Namespace) -> str:
    lines = [f"Decode tok/s, greedy, {a.tokens} tokens (EOS ignored), {a.runs} run(s), "
             f"{a.prompts_per_suite} prompt(s) per suite, quantization {a.quantization}, "
             f"threads {a.threads or 'auto'}. Speedup: median of paired ratios vs plain greedy.", "",
             "| model | config | suite | decode tok/s (min / median / max) | speedup | acceptance | "
             "mean acc. length | draft forwards / token | identical to greedy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        fmt = (lambda v, f: "-" if v is None else f.format(v))
        lines.append(f"| {s['model']} | {s['config']} | {s['suite']} | {s['decode_tps_min']:.1f} / "
                     f"**{s['decode_tps_median']:.1f}** / {s['decode_tps_max']:.1f} | "
                     f"{s['speedup_median']:.2f}x | {fmt(s['acceptance_rate'], '{:.1%}')} | "
                     f"{fmt(s['mean_acceptance_length'], '{:.2f}')} | "
                     f"{fmt(s['draft_forwards_per_token'], '{:.2f}')} | {s['identical']} |")
    return "\n".join(lines) + "\n"


def main(adjust=None) -> int:
    """adjust: see bench_model (a script running this benchmark with a variant of an engine)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--drafters", default=None, help="comma list to keep, e.g. ngram or draft")
    ap.add_argument("--spec", action="append", default=None, metavar="LABEL=JSON",
                    help="a speculative config to compare (repeatable; replaces the built-in drafters)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--suites", default="code,math,prose")
    ap.add_argument("--prompts-per-suite", type=int, default=4)
    ap.add_argument("--adaptive", choices=["on", "off", "both"], default="on",
                    help='"adaptive" in the speculative config (both: compare the two)')
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "q4", "q4_0"])
    ap.add_argument("--ctx", type=int, default=2048, help="--max-model-len of every engine (KV pool size)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--by-run", action="store_true", help="summarize each run apart (suffix: run 2 is a repeat)")
    ap.add_argument("--out", default=None, help="write raw rows and summary as JSON")
    ap.add_argument("--markdown", default=None, help="write the summary table as Markdown")
    a = ap.parse_args()
    suites = load_suites(a.suites, a.prompts_per_suite)
    rows = []
    for model in a.models.split(","):
        rows += bench_model(model.strip(), a, suites, adjust)
    summary = summarize(rows, a.by_run)
    md = markdown(summary, a)
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "rows": rows}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
