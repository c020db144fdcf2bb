"""specserve vs native llama.cpp servers: the same GGUF, chat prompts and token counts over HTTP.

    python benchmarks/native_llamacpp.py [--model qwen2.5-coder-1.5b] [--tokens 128] [--rounds 2]
        [--suites code,math,prose,edit] [--limit 2] [--configs all] [--isa native|avx2] [--interleave]
        [--out r.json] [--markdown r.md]
    python benchmarks/native_llamacpp.py --build-only [--isa avx2]     # just build llama-server / llama-bench

llama.cpp is built from the source inside the llama-cpp-python sdist (``vendor/llama.cpp``, pinned
below) with cmake and ``-DGGML_NATIVE=ON`` on this machine, cached under the user cache dir
(``~/.cache/specserve/llama.cpp-native/VERSION``); the first build takes several minutes on 2 cores.
``--isa avx2`` builds llama.cpp for AVX2 alone (``-DGGML_NATIVE=OFF``: AVX, AVX2, FMA, F16C, BMI2,
no AVX-512, no VNNI; a second build directory) and runs our servers with
``SPECSERVE_KERNEL_VARIANT=avx2``: both engines as an AVX2-only CPU (a Zen 3) runs them.

One server runs at a time (the machines are shared: two servers would share the cores). Every
round starts each configuration's server in turn (the order rotated per round), warms it up with
one request, then sends every prompt once: ``/v1/chat/completions``, temperature 0, ``ignore_eos``
and ``max_tokens`` fixed, so both engines generate exactly ``--tokens`` tokens (a base model
without a chat template, gemma3-270m: ``/v1/completions`` with the conversation as "Role: text"
lines, the same string for both). tok/s is
completion tokens over the client's wall clock for the request (prefill of the short chat
prompts included, as a user sees it). "vs llama.cpp" is the median over (prompt, round) of the
ratio to llama.cpp plain on the same prompt and round; "same text" counts outputs identical to
the same engine's plain greedy output.

``--interleave``: this machine's speed changes for minutes at a time (the same forward 26 or 33 ms),
and a server that runs its whole round in a slow spell loses a ratio it would win in the next. So
all the servers start first (one after the other, each warmed up) and stay up, and each prompt goes
to every configuration in turn, the order rotated prompt by prompt: one server works at a time while
the others wait idle (their CPU use while idle is measured and printed). Rounds after the first ask
the same prompts again, which both engines then find in their prompt caches (llama.cpp's
``--cache-ram``, our prefix cache); use ``--rounds 1`` and more prompts (``--limit``) to keep
prefill in every wall-clock figure.

llama.cpp's speculative configurations are its own (``--spec-type ngram-simple``, ``ngram-mod``,
``--spec-type draft-simple -md DRAFT --spec-draft-n-max N``); ours are the ``--speculative-config`` JSON of each row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specserve.bench.fetch import pip_download  # noqa: E402
from specserve.bench.serverproc import ManagedServer, free_port  # noqa: E402
from specserve.bench.suites import load_suites  # noqa: E402
from specserve.engine.types import AcceptanceStats  # noqa: E402
from specserve.kernels.build import cpu_signature  # noqa: E402
from specserve.models.catalog import CATALOG, cache_root, resolve_model  # noqa: E402

LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python sdist whose vendor/llama.cpp is built
TARGETS = ("llama-server", "llama-bench")
DRAFT_FOR = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}
CTX = 4096
# ggml's AMX matmul dies with SIGILL in llama-server's worker threads on a VM whose CPU reports
# AMX without enabling its tile state (seen on an Intel Xeon, family 6 model 207); our kernels do
# not use AMX either, so both sides run AVX-512 VNNI
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


# ---------------------------------------------------------------- building llama.cpp

def native_dir(version: str = LLAMACPP_VERSION) -> Path:
    return cache_root() / "llama.cpp-native" / version


# the instruction sets a build targets: this CPU's (-march=native), or AVX2 alone as on a Zen 3
# (ggml's GGML_NATIVE=OFF default: SSE4.2, AVX, AVX2, FMA, F16C, BMI2; no AVX-512, no VNNI)
ISA_FLAGS = {"native": ["-DGGML_NATIVE=ON"], "avx2": ["-DGGML_NATIVE=OFF"]}
# our kernels' build for each: the one the start-up contest picks, or the AVX2 one
ISA_ENV = {"native": {}, "avx2": {"SPECSERVE_KERNEL_VARIANT": "avx2"}}


def build_dir(version: str = LLAMACPP_VERSION, isa: str = "native") -> Path:
    return native_dir(version) / ("build" if isa == "native" else f"build-{isa}")


def build_native(version: str = LLAMACPP_VERSION, isa: str = "native") -> Path:
    """The directory holding llama-server and llama-bench for ISA (ISA_FLAGS), built once from the
    sdist's source."""
    top, build = native_dir(version), build_dir(version, isa)
    bindir = build / "bin"
    stamp = build / "specserve-flags"
    # objects for this CPU (native) or for any AVX2 CPU; a native build from another CPU is rebuilt
    want = f"{NO_AMX}\n{cpu_signature()}" if isa == "native" else f"{NO_AMX}\n{isa}"
    if stamp.exists() and stamp.read_text() != want:  # cmake would relink the old objects: start over
        shutil.rmtree(build)
    if all((bindir / t).exists() for t in TARGETS) and stamp.exists():
        return bindir
    top.mkdir(parents=True, exist_ok=True)
    src = top / "src"
    if not (src / "CMakeLists.txt").exists():
        sdists = list(top.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            print(f"downloading the llama-cpp-python {version} sdist", file=sys.stderr, flush=True)
            pip_download(f"llama-cpp-python=={version}", top)
            sdists = list(top.glob("llama_cpp_python-*.tar.gz"))
        _extract_vendor(sdists[0], src)
    log = top / ("build.log" if isa == "native" else f"build-{isa}.log")
    print(f"building ({isa}) {', '.join(TARGETS)} from {src} (minutes on 2 cores; log: {log})",
          file=sys.stderr, flush=True)
    jobs = build_jobs()
    configure = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 *ISA_FLAGS[isa], "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_TOOLS=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    make = ["cmake", "--build", str(build), "-j", jobs, "--target", *TARGETS]
    t0 = time.time()
    with open(log, "w") as f:
        for cmd in (configure, make):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                sys.exit(f"llama.cpp build failed ({' '.join(cmd[:2])}); tail of {log}:\n{log.read_text()[-3000:]}")
    stamp.write_text(want)
    print(f"built in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return bindir


def native_tool(name: str, version: str = LLAMACPP_VERSION) -> Path:
    """Another program of the native build (llama-quantize, ...), built into it when first asked for."""
    bindir = build_native(version)
    if not (bindir / name).exists():
        subprocess.run(["cmake", "--build", str(bindir.parent), "-j", build_jobs(), "--target", name], check=True,
                       stdout=subprocess.DEVNULL)
    return bindir / name


def build_jobs() -> str:
    """cmake's -j: BUILD_JOBS, else the CPUs this process may use."""
    return os.environ.get("BUILD_JOBS", str(len(os.sched_getaffinity(0))))


def _extract_vendor(sdist: Path, dest: Path) -> None:
    """Unpack ``<sdist>/vendor/llama.cpp/`` into ``dest``."""
    with tarfile.open(sdist) as tf:
        members = []
        for m in tf.getmembers():
            parts = m.name.split("/", 3)
            if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and (m.isfile() or m.isdir()):
                m.name = parts[3]
                members.append(m)
        tf.extractall(dest, members=members, filter="data")


# ---------------------------------------------------------------- configurations

def gguf_of(model: str) -> Path:
    path = resolve_model(model).path
    if path.suffix != ".gguf":
        sys.exit(f"{model} is not a GGUF file ({path}); llama.cpp needs one")
    return path


# llama.cpp's CPU weights (repacked at load) come from malloc; this glibc (2.35+) tunable has malloc advise
# huge pages for its large chunks: llama.cpp's counterpart to specserve's huge-page weights
HUGE_PAGES_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def llama_bench_rows(bench: Path, gguf: Path, *args: str, env: dict | None = None) -> list[dict]:
    """llama-bench's JSON result rows for one model: 2 threads, 2 repetitions, then ``args``; ``env``:
    variables added to this process's environment (HUGE_PAGES_ENV)."""
    res = subprocess.run([str(bench), "-m", str(gguf), "-t", "2", "-r", "2", "-o", "json", *args],
                         capture_output=True, text=True, check=True, env={**os.environ, **env} if env else None)
    return json.loads(res.stdout)


def env_prefix(env: dict[str, str]) -> list[str]:
    """A command line's start that runs the rest with ENV added (``env VAR=value ...``)."""
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def configurations(model: str, bindir: Path, isa: str = "native", ctx: int = CTX) -> dict[str, list[str]]:
    """label -> server command line without the port (added per start); ours with the kernel build
    for ISA (ISA_ENV), llama.cpp's from BINDIR; both with a context of ctx tokens."""
    gguf = str(gguf_of(model))
    lcpp = [str(bindir / "llama-server"), "-m", gguf, "-t", "2", "-fa", "on", "-c", str(ctx),
            "--no-webui", "--host", "127.0.0.1"]
    ours = [*env_prefix(ISA_ENV[isa]), sys.executable, "-m", "specserve", "serve", "--model", model,
            "--max-model-len", str(ctx), "--host", "127.0.0.1"]
    draft = DRAFT_FOR.get(model)
    out = {"llama.cpp plain": lcpp,
           "llama.cpp ngram-simple": lcpp + ["--spec-type", "ngram-simple"],
           "llama.cpp ngram-mod": lcpp + ["--spec-type", "ngram-mod"],
           "llama.cpp plain THP": env_prefix(HUGE_PAGES_ENV) + lcpp}
    if draft:
        # -md alone loads the draft and leaves it unused: this llama.cpp drafts only with a --spec-type
        out["llama.cpp draft-simple"] = lcpp + ["--spec-type", "draft-simple", "-md", str(gguf_of(draft)),
                                                "--spec-draft-n-max", "8"]
    out |= {"specserve plain": ours,
            "specserve ngram": ours + ["--speculative-config", '{"method": "ngram"}'],
            "specserve suffix": ours + ["--speculative-config", '{"method": "suffix"}']}
    if draft:
        out["specserve draft"] = ours + ["--speculative-config", json.dumps(
            {"method": "draft_model", "model": draft, "num_speculative_tokens": 8})]
        # the draft in 4 bits over a 32K-token draft vocabulary (README "The 0.5b draft model")
        small = {"method": "draft_model", "model": draft, "num_speculative_tokens": 8, "quantization": "q4_0",
                 "draft_vocab_size": 32768}
        out["specserve draft q4_0 32K"] = ours + ["--speculative-config", json.dumps(small)]
        # the same without prompt lookup's guesses in the draft's forwards (before 2026-12-06)
        out["specserve draft q4_0 32K no lookup"] = ours + ["--speculative-config", json.dumps(
            {**small, "draft_lookup_tokens": 0})]
        # the same draft stopping at its first unsure token (llama.cpp's --draft-p-min)
        out["specserve draft q4_0 32K p_min 0.3"] = ours + ["--speculative-config", json.dumps(
            {**small, "draft_p_min": 0.3})]
        # after a long prompt the draft reads all of it (before 2026-12-07), or a 512-token window (the
        # default window is DEFAULT_DRAFT_WINDOW)
        out["specserve draft q4_0 32K read all"] = ours + ["--speculative-config", json.dumps(
            {**small, "draft_window": 0})]
        out["specserve draft q4_0 32K window 512"] = ours + ["--speculative-config", json.dumps(
            {**small, "draft_window": 512})]
        out["specserve draft q4_0 32K window 1024"] = ours + ["--speculative-config", json.dumps(
            {**small, "draft_window": 1024})]
        # suffix decoding first, the draft where suffix has nothing (README "Chains")
        out["specserve suffix then draft q4_0 32K"] = ours + ["--speculative-config", json.dumps(
            {"method": "chain", "num_speculative_tokens": 8, "drafters": [{"method": "suffix"}, small]})]
    return out


# ---------------------------------------------------------------- measuring

def as_text(messages: list[dict]) -> str:
    """A conversation as plain text, for a base model without a chat template (both engines get
    the same string on /v1/completions)."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"


def ask(http: httpx.Client, model: str, messages: list[dict], tokens: int, chat: bool = True) -> dict:
    body = {"model": model, "temperature": 0, "max_tokens": tokens, "ignore_eos": True}
    body |= {"messages": messages} if chat else {"prompt": as_text(messages)}
    t0 = time.perf_counter()
    r = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    n = data["usage"]["completion_tokens"]
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return {"text": text, "tokens": n, "wall_s": wall, "tok_s": n / wall, **spec_counts(data)}


def spec_counts(data: dict) -> dict:
    """What both servers report in llama.cpp's ``timings`` field: decode tok/s (prefill excluded)
    and, with speculation, the tokens drafted and accepted; ours also counts its verification steps
    (``usage.speculative``), which gives the mean acceptance length (tokens per target forward)."""
    t = data.get("timings") or {}
    out = {"decode_tok_s": t.get("predicted_per_second"), "drafted": t.get("draft_n"),
           "accepted": t.get("draft_n_accepted")}
    spec = data.get("usage", {}).get("speculative")
    if spec:
        out["steps"] = spec["steps"]
    return out


@contextlib.contextmanager
def serving(label: str, argv: list[str], chat: bool = True):
    """A started server: yields (http client, served model name, server); stopped on exit."""
    port = free_port()
    srv = ManagedServer(argv + ["--port", str(port)], port, label).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=900) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]  # the served name
            yield http, model, srv
    finally:
        srv.stop()


def suite_prompts(spec: str, limit: int | None) -> tuple[list[str], list]:
    """(the suites' names, their prompts in order) for --suites: a JSONL path's suite is named after
    its file (``long.jsonl``: "long"), as its prompts are, so the tables find them."""
    loaded = load_suites(spec, limit)
    return list(loaded), [p for ps in loaded.values() for p in ps]


def warm_up(http: httpx.Client, model: str, prompts: list, chat: bool) -> None:
    """One request of 16 tokens before any measured one (first-call costs out of the figures)."""
    ask(http, model, prompts[0].as_messages(), 16, chat)


def measure(label: str, http: httpx.Client, model: str, p, tokens: int, chat: bool) -> dict:
    res = ask(http, model, p.as_messages(), tokens, chat)
    print(f"  {label:24s} {p.suite}/{p.id}: {res['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return {"config": label, "prompt": f"{p.suite}/{p.id}", "suite": p.suite, **res}


def run_server(label: str, argv: list[str], prompts: list, tokens: int, chat: bool = True) -> list[dict]:
    """One configuration's server alone: started, every prompt once, stopped."""
    with serving(label, argv, chat) as (http, model, _):
        warm_up(http, model, prompts, chat)
        return [measure(label, http, model, p, tokens, chat) for p in prompts]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_interleaved(configs: dict[str, list[str]], labels: list[str], prompts: list, tokens: int, rounds: int,
                    chat: bool = True) -> tuple[list[dict], dict[str, float]]:
    """Every configuration's server up at once, asked in turn prompt by prompt (the order rotated
    per prompt and round), so that a minutes-long change in the machine's speed falls on all of them
    alike; only the asked server works, the others wait idle. Also returns each server's CPU use
    while all sat idle after the warm-up (share of one core over 3 s), which shows that they do."""
    with contextlib.ExitStack() as stack:
        up = {label: stack.enter_context(serving(label, configs[label], chat)) for label in labels}
        for http, model, _ in up.values():
            warm_up(http, model, prompts, chat)
        before = {label: cpu_seconds(srv.proc.pid) for label, (_, _, srv) in up.items()}
        time.sleep(3.0)
        idle = {label: (cpu_seconds(srv.proc.pid) - before[label]) / 3.0 for label, (_, _, srv) in up.items()}
        results = []
        for rnd in range(rounds):
            for i, p in enumerate(prompts):
                k = (rnd * len(prompts) + i) % len(labels)
                for label in labels[k:] + labels[:k]:
                    http, model, _ = up[label]
                    results.append({**measure(label, http, model, p, tokens, chat), "round": rnd})
    return results, idle


def summarize(results: list[dict], labels: list[str], suites: list[str]) -> list[dict]:
    by = {(r["config"], r["prompt"], r["round"]): r for r in results}
    rows = []
    for label in labels:
        plain = "llama.cpp plain" if label.startswith("llama.cpp") else "specserve plain"
        for suite in suites + ["all"]:
            mine = [r for r in results if r["config"] == label and suite in ("all", r["suite"])]
            if not mine:
                continue
            base = [by.get(("llama.cpp plain", r["prompt"], r["round"])) for r in mine]
            same = [by.get((plain, r["prompt"], r["round"])) for r in mine]
            ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(mine, base) if b]
            rows.append({
                "config": label, "suite": suite,
                "tok_s": statistics.median(r["tok_s"] for r in mine),
                "vs_llamacpp": statistics.median(ratios) if ratios else None,  # (llama.cpp plain not run)
                "same_text": same_text(mine, same),
                **acceptance(mine),
            })
    return rows


def same_text(mine: list[dict], plain: list[dict | None]) -> str:
    """How many of a configuration's outputs equal its engine's plain output on the same prompt and
    round, as "n/N"; "-" when that plain configuration was not run (nothing to compare with)."""
    if all(p is None for p in plain):
        return "-"
    return f"{sum(p is not None and p['text'] == r['text'] for r, p in zip(mine, plain))}/{len(mine)}"


def acceptance(runs: list[dict]) -> dict:
    """Over a configuration's requests: median decode tok/s, the share of drafted tokens accepted,
    and (ours) the mean acceptance length, tokens per verification step (the accepted drafts plus
    the target's own token); None where the server reported nothing."""
    dec = [r["decode_tok_s"] for r in runs if r.get("decode_tok_s")]
    total = AcceptanceStats(steps=sum(r.get("steps") or 0 for r in runs),
                            draft_tokens=sum(r.get("drafted") or 0 for r in runs),
                            accepted_tokens=sum(r.get("accepted") or 0 for r in runs))
    return {"decode_tok_s": statistics.median(dec) if dec else None, "drafted": total.draft_tokens,
            "acceptance_rate": total.acceptance_rate if total.draft_tokens else None,
            "mean_acceptance_length": total.mean_acceptance_length if total.steps else None}


def markdown(rows: list[dict], args: argparse.Namespace, idle: dict[str, float] | None = None) -> str:
    """One line per configuration: tok/s (ratio to llama.cpp plain) per suite, as in the README;
    IDLE: each server's CPU share while idle (--interleave)."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    suites = list(dict.fromkeys(r["suite"] for r in rows if r["suite"] != "all"))
    by = {(r["config"], r["suite"]): r for r in rows}
    flags = ("" if getattr(args, "isa", "native") == "native" else f" --isa {args.isa}") + \
        (" --interleave" if getattr(args, "interleave", False) else "") + \
        (f" --ctx {args.ctx}" if getattr(args, "ctx", CTX) != CTX else "")
    lines = [f"`benchmarks/native_llamacpp.py --model {args.model} --tokens {args.tokens} --rounds {args.rounds} "
             f"--limit {args.limit}{flags}` on {cpu}, {len(os.sched_getaffinity(0))} cores (median tok/s):", "",
             "| configuration | " + " | ".join(suites) + " | same text as its plain |",
             "|---|" + "---|" * (len(suites) + 1)]
    for label in dict.fromkeys(r["config"] for r in rows):
        cells = [f"{by[label, s]['tok_s']:.1f}" + ("" if by[label, s]["vs_llamacpp"] is None
                                                   else f" ({by[label, s]['vs_llamacpp']:.2f}x)") for s in suites]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {by[label, 'all']['same_text']} |")
    lines += ["", "Decode only (the servers' own `timings`, prefill excluded), median tok/s per suite; speculation: "
              "accepted share of the drafted tokens, and mean acceptance length (tokens per target forward, "
              "specserve's `usage.speculative`):", "",
              "| configuration | " + " | ".join(suites) + " | accepted | mean acc. length |",
              "|---|" + "---|" * (len(suites) + 2)]
    for label in dict.fromkeys(r["config"] for r in rows):
        cells = [fmt(by[label, s]["decode_tok_s"], "{:.1f}") for s in suites]
        tot = by[label, "all"]
        rate = ("-" if "plain" in label.split() else "none drafted" if not tot["drafted"]
                else f"{tot['acceptance_rate']:.0%}")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {rate} | "
                     f"{fmt(tot['mean_acceptance_length'], '{:.2f}')} |")
    if idle:
        lines += ["", "All servers were up at once and asked in turn; idle, after the warm-up, they used "
                  + ", ".join(f"{label} {share:.1%}" for label, share in idle.items()) + " of a core."]
    return "\n".join(lines) + "\n"


def fmt(x, spec: str) -> str:
    return "-" if x is None else spec.format(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--suites", default="code,math,prose,edit")
    ap.add_argument("--limit", type=int, default=2, help="prompts per suite")
    ap.add_argument("--ctx", type=int, default=CTX, help="both servers' context length (tokens)")
    ap.add_argument("--configs", default="all", help="comma list of labels (default: all)")
    ap.add_argument("--isa", choices=tuple(ISA_FLAGS), default="native",
                    help="both engines built for this CPU, or for AVX2 alone (as on a Zen 3)")
    ap.add_argument("--interleave", action="store_true",
                    help="all servers up at once, asked in turn prompt by prompt (the idle ones wait)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    bindir = build_native(isa=args.isa)
    if args.build_only:
        print(bindir)
        return
    configs = configurations(args.model, bindir, args.isa, args.ctx)
    labels = list(configs) if args.configs == "all" else args.configs.split(",")
    suites, prompts = suite_prompts(args.suites, args.limit)
    chat = CATALOG[args.model].chat_template if args.model in CATALOG else True  # else /v1/completions
    if args.interleave:
        results, idle = run_interleaved(configs, labels, prompts, args.tokens, args.rounds, chat)
    else:
        results, idle = [], None
        for rnd in range(args.rounds):
            order = labels[rnd % len(labels):] + labels[:rnd % len(labels)]
            for label in order:
                for r in run_server(label, configs[label], prompts, args.tokens, chat):
                    results.append({**r, "round": rnd})
    rows = summarize(results, labels, suites)
    text = markdown(rows, args, idle)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "results": results, "idle_cpu": idle}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
