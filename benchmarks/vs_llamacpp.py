"""specserve vs llama.cpp (llama-cpp-python) on the same GGUF, prompts and token counts.

    python benchmarks/vs_llamacpp.py [--model smollm2-135m] [--tokens 128] [--runs 3]
        [--suites code,math,prose] [--prompts-per-suite 4] [--out vs.json] [--markdown vs.md]

First use builds llama-cpp-python (pinned below) into benchmarks/.venv-llamacpp, compiling llama.cpp
with CMAKE_ARGS="-DGGML_NATIVE=ON" (several minutes on 2 cores; the log is in the venv).

Every configuration is a long-lived worker process (one model load each, so each has its own peak
RSS): llama.cpp (flash_attn, n_batch 512, --threads threads) and specserve plain greedy, ngram and,
for qwen2.5-coder-1.5b, the 0.5b draft model (4-bit, 32K draft vocabulary). The prompt is rendered with the model's chat template
and tokenized ONCE by specserve; both engines get the same token ids, decode greedily and ignore EOS
for exactly --tokens tokens. Per prompt and run the workers take turns (order rotated).

Decode tok/s = (tokens - 1) / (wall time from the first generated token to the last), for both.
llama.cpp's loop is llm.eval([tok]) + argmax over the last logits (no sampler chain, the cheapest
greedy step llama-cpp-python allows); llama.cpp's own counter (llama_perf_context: n_eval / t_eval)
is reported next to it. "vs llama.cpp" is the median over (prompt, run) of the paired ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
LLAMACPP_VERSION = "0.3.36"
DRAFT_FOR = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b", "qwen2.5-coder-3b": "qwen2.5-coder-0.5b"}

LLAMA_DRIVER = r'''
import json, os, sys, time
out = os.fdopen(os.dup(1), "w", buffering=1); os.dup2(2, 1)  # stray C prints go to stderr
import numpy as np, llama_cpp
a = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=a["model"], n_ctx=a["ctx"], n_batch=512, n_threads=a["threads"],
                      n_threads_batch=a["threads"], flash_attn=True, n_gpu_layers=0, verbose=False)
ctx, nv = llm._ctx.ctx, llm.n_vocab()
def argmax():
    return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(nv,)).argmax())
for line in sys.stdin:
    req = json.loads(line)
    if req.get("cmd") == "rss":
        st = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
        out.write(json.dumps({k: int(st[k].split()[0]) for k in ("VmHWM", "VmRSS")}) + "\n"); continue
    llm.reset(); llama_cpp.llama_perf_context_reset(ctx)
    t0 = time.perf_counter(); llm.eval(req["ids"]); toks = [argmax()]; t1 = time.perf_counter()
    while len(toks) < req["n"]:
        llm.eval([toks[-1]]); toks.append(argmax())
    t2 = time.perf_counter(); p = llama_cpp.llama_perf_context(ctx)
    out.write(json.dumps({"tokens": toks, "prefill_s": t1 - t0, "decode_s": t2 - t1,
                          "perf_eval_tps": p.n_eval / p.t_eval_ms * 1e3 if p.t_eval_ms else None}) + "\n")
'''


def ensure_llamacpp(venv: Path) -> Path:
    """The venv's python, with llama-cpp-python installed (built from source when no wheel fits)."""
    py = venv / "bin" / "python"
    check = f"import llama_cpp, sys; sys.exit(llama_cpp.__version__ != {LLAMACPP_VERSION!r})"
    if py.exists() and subprocess.run([py, "-c", check], capture_output=True).returncode == 0:
        return py
    if not py.exists():
        print(f"creating {venv}", file=sys.stderr, flush=True)
        subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
        (venv / ".gitignore").write_text("*\n")
    env = dict(os.environ)
    env.setdefault("CMAKE_ARGS", "-DGGML_NATIVE=ON")
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(len(os.sched_getaffinity(0))))
    log = venv / "build.log"
    print(f"installing llama-cpp-python=={LLAMACPP_VERSION} (CMAKE_ARGS={env['CMAKE_ARGS']!r}); "
          f"compiling llama.cpp takes minutes; log: {log}", file=sys.stderr, flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen([py, "-m", "pip", "install", "-v", f"llama-cpp-python=={LLAMACPP_VERSION}"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
        while True:
            try:
                proc.wait(timeout=20)
                break
            except subprocess.TimeoutExpired:
                pass
            steps = re.findall(r"\[\d+/\d+\]", log.read_text(errors="replace"))
            print(f"  ... {time.time() - t0:.0f}s {steps[-1] if steps else ''}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        sys.exit(f"llama-cpp-python install failed; tail of {log}:\n" + log.read_text()[-3000:])
    print(f"llama-cpp-python installed in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return py


class Worker:
    """A long-lived process answering one JSON line per request."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"worker {self.name} died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def specserve_worker(argv: list[str]) -> None:
    """Worker mode of this script: one specserve engine, requests on stdin, JSON lines out."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from specserve.commands.args import add_engine_args
    from specserve.engine.builder import build_engine
    from specserve.engine.types import SamplingParams

    p = argparse.ArgumentParser()
    add_engine_args(p)
    engine = build_engine(p.parse_args(argv))
    for i, line in enumerate(sys.stdin):
        req = json.loads(line)
        if req.get("cmd") == "rss":
            st = dict(x.split(":", 1) for x in open("/proc/self/status") if ":" in x)
            out.write(json.dumps({k: int(st[k].split()[0]) for k in ("VmHWM", "VmRSS")}) + "\n")
            continue
        toks, last = [], None
        for o in engine.generate(req["ids"], SamplingParams(max_tokens=req["n"], ignore_eos=True), f"r{i}"):
            toks += o.new_token_ids
            last = o
        res = {"tokens": toks, "prefill_s": last.prefill_time, "decode_s": last.decode_time}
        if last.acceptance is not None:
            res["spec"] = {k: last.acceptance.to_dict()[k] for k in ("steps", "draft_tokens", "accepted_tokens")}
        out.write(json.dumps(res) + "\n")


def start_workers(a: argparse.Namespace) -> dict[str, Worker]:
    from specserve.models.catalog import resolve_model

    gguf = resolve_model(a.model).path
    py = ensure_llamacpp(Path(a.venv))
    driver = Path(a.venv) / "llama_driver.py"
    driver.write_text(LLAMA_DRIVER)
    largs = json.dumps({"model": str(gguf), "ctx": a.ctx, "threads": a.threads})
    base = [sys.executable, __file__, "--worker", "--model", a.model, "--quantization", a.quantization,
            "--threads", str(a.threads), "--max-num-seqs", "1", "--max-model-len", str(a.ctx)]
    specs = {"specserve": None, "specserve ngram": {"method": "ngram", "num_speculative_tokens": 8}}
    if a.model in DRAFT_FOR and not a.no_draft:
        specs["specserve draft"] = {"method": "draft_model", "model": DRAFT_FOR[a.model], "num_speculative_tokens": 5,
                                    "quantization": "q4_0", "draft_vocab_size": 32768}
    workers = {"llama.cpp": Worker("llama.cpp", [str(py), str(driver), largs])}
    for name, spec in specs.items():
        workers[name] = Worker(name, base + (["--speculative-config", json.dumps(spec)] if spec else []))
    print(f"GGUF: {gguf}", file=sys.stderr, flush=True)
    return workers


def prompt_ids(a: argparse.Namespace) -> list[tuple[str, str, list[int]]]:
    from specserve.bench.suites import load_suites
    from specserve.models.chat_template import ChatTemplate
    from specserve.models import tokenizer as mtok
    from specserve.models.catalog import cache_root, resolve_model
    from specserve.models.loader import _identity

    res = resolve_model(a.model)  # the tokenizer only, as the loader builds it (no weights)
    tok = mtok.from_gguf(res.path, cache_root() / "tokenizers" / _identity(res))
    ct = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    out = []
    for suite, ps in load_suites(a.suites, a.prompts_per_suite).items():
        for p in ps:
            ids = tok.encode(ct.render(p.as_messages()), add_special_tokens=False)
            if len(ids) + a.tokens + 16 <= a.ctx:
                out.append((suite, p.id, ids))
    return out


def common_prefix(x: list[int], y: list[int]) -> int:
    return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))


def main() -> int:
    if "--worker" in sys.argv:
        specserve_worker([x for x in sys.argv[1:] if x != "--worker"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--suites", default="code,math,prose")
    ap.add_argument("--prompts-per-suite", type=int, default=4)
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "q4", "q4_0"],
                    help="specserve's run-time weight format (llama.cpp runs the GGUF as stored)")
    ap.add_argument("--ctx", type=int, default=2048, help="n_ctx of llama.cpp = --max-model-len of specserve")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model configuration")
    ap.add_argument("--venv", default=str(HERE / ".venv-llamacpp"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    prompts = prompt_ids(a)
    workers = start_workers(a)
    names = list(workers)
    for w in workers.values():  # warm-up (and wait for every model load)
        w.ask({"ids": prompts[0][2], "n": 8})
    rows = []
    for run in range(a.runs):
        for pi, (suite, pid, ids) in enumerate(prompts):
            k = (pi + run) % len(names)
            res = {n: workers[n].ask({"ids": ids, "n": a.tokens}) for n in names[k:] + names[:k]}
            for n in names:
                r = res[n]
                r["decode_tps"] = (len(r["tokens"]) - 1) / max(r["decode_s"], 1e-9)
            for n in names:
                r = res[n]
                rows.append({"config": n, "suite": suite, "prompt": pid, "run": run, "decode_tps": r["decode_tps"],
                             "vs_llamacpp": r["decode_tps"] / res["llama.cpp"]["decode_tps"],
                             "perf_eval_tps": r.get("perf_eval_tps"), "spec": r.get("spec"),
                             "same_as_specserve_plain": r["tokens"] == res["specserve"]["tokens"],
                             "prefix_agree_llamacpp": common_prefix(r["tokens"], res["llama.cpp"]["tokens"]),
                             "tokens": r["tokens"] if run == 0 else None})
            print(f"run {run + 1}/{a.runs} {pid} ({len(ids)} prompt tokens): " + "  ".join(
                f"{n}={res[n]['decode_tps']:.1f}" for n in names), file=sys.stderr, flush=True)
    rss = {n: w.ask({"cmd": "rss"}) for n, w in workers.items()}
    for w in workers.values():
        w.close()
    summary = summarize(rows, names, [s for s, _, _ in prompts])
    md = markdown(summary, rss, a)
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "rss_kb": rss, "rows": rows}, f, indent=1)
    if a.markdown:
        Path(a.markdown).write_text(md)
    return 0


def summarize(rows: list[dict], names: list[str], suites: list[str]) -> list[dict]:
    out = []
    for suite in list(dict.fromkeys(suites)) + ["all"]:
        for n in names:
            rs = [r for r in rows if r["config"] == n and suite in (r["suite"], "all")]
            tps = [r["decode_tps"] for r in rs]
            sp = [r["spec"] for r in rs if r["spec"]]
            steps, dr, acc = (sum(s[k] for s in sp) for k in ("steps", "draft_tokens", "accepted_tokens"))
            perf = [r["perf_eval_tps"] for r in rs if r["perf_eval_tps"]]
            prompts = {r["prompt"] for r in rs}
            same = {p for p in prompts if all(r["same_as_specserve_plain"] for r in rs if r["prompt"] == p)}
            out.append({"config": n, "suite": suite, "n": len(rs), "decode_tps_min": min(tps),
                        "decode_tps_median": statistics.median(tps), "decode_tps_max": max(tps),
                        "vs_llamacpp_median": statistics.median(r["vs_llamacpp"] for r in rs),
                        "perf_eval_tps_median": statistics.median(perf) if perf else None,
                        "acceptance_rate": acc / dr if dr else None,
                        "mean_acceptance_length": (acc + steps) / steps if steps else None,
                        "identical_to_plain": f"{len(same)}/{len(prompts)}",
                        "prefix_agree_llamacpp": statistics.mean(r["prefix_agree_llamacpp"] for r in rs)})
    return out


def markdown(summary: list[dict], rss: dict, a: argparse.Namespace) -> str:
    f = (lambda v, fmt: "-" if v is None else fmt.format(v))
    lines = [f"{a.model}, greedy, {a.tokens} tokens (EOS ignored), {a.runs} run(s) x {a.prompts_per_suite} "
             f"prompt(s)/suite, {a.threads} threads, ctx {a.ctx}, specserve quantization {a.quantization}, "
             f"llama-cpp-python {LLAMACPP_VERSION} (flash_attn, n_batch 512). Decode tok/s = wall time first->last "
             "token; vs llama.cpp = median of paired ratios. llama.cpp's own n_eval/t_eval in brackets.", "",
             "| suite | engine | decode tok/s (min / median / max) | vs llama.cpp | acceptance | mean acc. len "
             "| identical to specserve greedy | tokens agreeing with llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        perf = f" [{s['perf_eval_tps_median']:.1f}]" if s["perf_eval_tps_median"] else ""
        lines.append(f"| {s['suite']} | {s['config']} | {s['decode_tps_min']:.1f} / **{s['decode_tps_median']:.1f}**"
                     f"{perf} / {s['decode_tps_max']:.1f} | {s['vs_llamacpp_median']:.2f}x | "
                     f"{f(s['acceptance_rate'], '{:.1%}')} | {f(s['mean_acceptance_length'], '{:.2f}')} | "
                     f"{s['identical_to_plain'] if s['config'] != 'llama.cpp' else '-'} | "
                     f"{s['prefix_agree_llamacpp']:.1f} / {a.tokens} |")
    lines += ["", "| process | peak RSS (VmHWM) | RSS at end |", "|---|---|---|"]
    lines += [f"| {n} | {r['VmHWM'] / 1024:.0f} MiB | {r['VmRSS'] / 1024:.0f} MiB |" for n, r in rss.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
