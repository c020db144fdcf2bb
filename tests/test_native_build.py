"""benchmarks/native_llamacpp.py's llama.cpp build: reused on the CPU it was built for, rebuilt
from scratch on another (its objects are -march=native; cmake alone would only relink them)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import subprocess
from pathlib import Path

import pytest


def _load_script():
    """benchmarks/native_llamacpp.py as a module, without putting benchmarks/ on sys.path for the rest
    of the session: a script there named like a package that transformers probes for (``kernels``,
    as benchmarks/kernel_times.py was once named) would shadow it in every later test."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "native_llamacpp.py"
    spec = importlib.util.spec_from_file_location("_bench_native_llamacpp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


nl = _load_script()


def test_a_build_from_another_cpu_is_rebuilt_and_this_cpus_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    top = nl.native_dir()
    (top / "src").mkdir(parents=True)
    (top / "src" / "CMakeLists.txt").write_text("")
    bindir = top / "build" / "bin"
    bindir.mkdir(parents=True)
    for t in nl.TARGETS:
        (bindir / t).write_text("")
    (top / "build" / "ggml-cpu.o").write_text("objects of the other CPU")
    (top / "build" / "specserve-flags").write_text(f"{nl.NO_AMX}\nanother CPU")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd[:3])
        if "--build" in cmd:  # what cmake writes
            bindir.mkdir(parents=True, exist_ok=True)
            for t in nl.TARGETS:
                (bindir / t).write_text("built")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(nl.subprocess, "run", fake_run)
    assert nl.build_native() == bindir
    assert not (top / "build" / "ggml-cpu.o").exists()  # started over
    assert [c[1] for c in calls] == ["-S", "--build"]
    assert (top / "build" / "specserve-flags").read_text() == f"{nl.NO_AMX}\n{nl.cpu_signature()}"
    calls.clear()
    assert nl.build_native() == bindir  # same CPU: reused
    assert calls == []


def test_the_table_reports_decode_speed_and_acceptance_from_the_servers_timings():
    """Both servers' ``timings`` (llama-server's fields) give decode tok/s and drafted / accepted
    counts; ours adds its verification steps, hence the mean acceptance length."""
    llama = {"timings": {"predicted_per_second": 20.0, "draft_n": 10, "draft_n_accepted": 5}, "usage": {}}
    ours = {"timings": {"predicted_per_second": 40.0, "draft_n": 12, "draft_n_accepted": 9},
            "usage": {"speculative": {"steps": 3}}}
    plain = {"timings": {"predicted_per_second": 30.0}, "usage": {}}
    assert nl.spec_counts(llama) == {"decode_tok_s": 20.0, "drafted": 10, "accepted": 5}
    assert nl.spec_counts(ours)["steps"] == 3

    def run(config, data, tok_s, text="t"):
        return {"config": config, "prompt": "code/p", "suite": "code", "round": 0, "tok_s": tok_s, "text": text,
                **nl.spec_counts(data)}

    results = [run("llama.cpp plain", plain, 10.0), run("llama.cpp ngram-mod", plain, 11.0),
               run("specserve plain", plain, 15.0), run("specserve draft", ours, 30.0)]
    rows = nl.summarize(results, [r["config"] for r in results], ["code"])
    by = {(r["config"], r["suite"]): r for r in rows}
    assert by["specserve draft", "code"]["vs_llamacpp"] == 3.0
    assert by["specserve draft", "all"]["acceptance_rate"] == 0.75
    assert by["specserve draft", "all"]["mean_acceptance_length"] == 4.0  # (3 steps + 9 accepted) / 3
    assert by["llama.cpp ngram-mod", "all"]["acceptance_rate"] is None
    assert by["specserve draft", "all"]["same_text"] == "1/1"
    # without specserve's plain row there is nothing to compare its speculation with: "-", not "0/1"
    alone = nl.summarize(results[:2] + results[3:], ["llama.cpp plain", "specserve draft"], ["code"])
    assert {r["config"]: r["same_text"] for r in alone if r["suite"] == "all"} == \
        {"llama.cpp plain": "1/1", "specserve draft": "-"}
    text = nl.markdown(rows, argparse.Namespace(model="m", tokens=8, rounds=1, limit=1))
    assert "| specserve draft | 40.0 | 75% | 4.00 |" in text
    assert "| llama.cpp ngram-mod | 30.0 | none drafted | - |" in text
    assert "| llama.cpp plain | 30.0 | - | - |" in text


def test_every_llamacpp_speculative_row_names_its_spec_type(monkeypatch, tmp_path):
    """llama-server drafts only with --spec-type: "-md DRAFT" alone loads the draft model and never
    uses it (a row labelled draft-simple measured plain decode until this test)."""
    monkeypatch.setattr(nl, "gguf_of", lambda model: tmp_path / f"{model}.gguf")
    configs = nl.configurations("qwen2.5-coder-1.5b", tmp_path)
    for label, argv in configs.items():
        if label.startswith("llama.cpp") and not label.startswith("llama.cpp plain"):
            kind = label.removeprefix("llama.cpp ")
            assert argv[argv.index("--spec-type") + 1] == kind, label
    assert "-md" in configs["llama.cpp draft-simple"]
    # the huge-page row is plain llama-server under glibc's tunable, nothing else changed
    thp = ["env", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"]
    assert configs["llama.cpp plain THP"] == thp + configs["llama.cpp plain"]


def test_the_avx2_build_has_its_own_directory_and_our_servers_run_the_avx2_kernels(tmp_path, monkeypatch):
    """--isa avx2: llama.cpp configured without -march=native (ggml's AVX2 default) beside the native
    build, reused on any CPU; our servers run with the AVX2 kernel build, llama.cpp's rows unchanged."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    (nl.native_dir() / "src").mkdir(parents=True)
    (nl.native_dir() / "src" / "CMakeLists.txt").write_text("")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        if "--build" in cmd:
            bindir = Path(cmd[cmd.index("--build") + 1]) / "bin"
            bindir.mkdir(parents=True, exist_ok=True)
            for t in nl.TARGETS:
                (bindir / t).write_text("built")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(nl.subprocess, "run", fake_run)
    bindir = nl.build_native(isa="avx2")
    assert bindir == nl.native_dir() / "build-avx2" / "bin"
    assert "-DGGML_NATIVE=OFF" in calls[0] and "-DGGML_NATIVE=ON" not in calls[0]
    calls.clear()
    monkeypatch.setattr(nl, "cpu_signature", lambda: "another CPU")
    assert nl.build_native(isa="avx2") == bindir and calls == []  # not tied to this CPU
    monkeypatch.setattr(nl, "gguf_of", lambda model: tmp_path / f"{model}.gguf")
    native = nl.configurations("qwen2.5-coder-1.5b", bindir)
    avx2 = nl.configurations("qwen2.5-coder-1.5b", bindir, "avx2")
    for label, argv in avx2.items():
        if label.startswith("specserve"):
            assert argv == ["env", "SPECSERVE_KERNEL_VARIANT=avx2"] + native[label], label
        else:
            assert argv == native[label], label


def test_interleaved_servers_are_all_up_and_asked_in_turn_prompt_by_prompt(monkeypatch):
    """--interleave: every server starts once and stays up; each prompt goes to every configuration,
    the order rotated per prompt; the idle CPU share of each server is measured once, after the
    warm-ups; and every server is stopped at the end."""
    events = []

    @contextlib.contextmanager
    def fake_serving(label, argv, chat=True):
        events.append(("start", label))
        yield label, "m", argparse.Namespace(proc=argparse.Namespace(pid=hash(label)))
        events.append(("stop", label))

    def fake_ask(http, model, messages, tokens, chat=True):
        events.append(("ask", http, messages[0]["content"], tokens))
        return {"text": f"{http}:{messages[0]['content']}", "tokens": tokens, "wall_s": 1.0, "tok_s": float(tokens)}

    monkeypatch.setattr(nl, "serving", fake_serving)
    monkeypatch.setattr(nl, "ask", fake_ask)
    cpu = {hash("a"): iter([1.0, 1.03]), hash("b"): iter([2.0, 2.0])}  # before / after the idle wait
    monkeypatch.setattr(nl, "cpu_seconds", lambda pid: next(cpu[pid]))
    monkeypatch.setattr(nl.time, "sleep", lambda s: None)
    prompts = [argparse.Namespace(suite="code", id=f"p{i}", as_messages=lambda i=i: [{"content": f"q{i}"}])
               for i in range(3)]
    results, idle = nl.run_interleaved({"a": [], "b": []}, ["a", "b"], prompts, 8, rounds=2)
    assert events[:2] == [("start", "a"), ("start", "b")] and events[-2:] == [("stop", "b"), ("stop", "a")]
    asks = [(e[1], e[2]) for e in events if e[0] == "ask" and e[3] == 8]
    assert asks == [("a", "q0"), ("b", "q0"), ("b", "q1"), ("a", "q1"), ("a", "q2"), ("b", "q2"),
                    ("b", "q0"), ("a", "q0"), ("a", "q1"), ("b", "q1"), ("b", "q2"), ("a", "q2")]
    assert [e[1] for e in events if e[0] == "ask" and e[3] == 16] == ["a", "b"]  # warm-ups, before any prompt
    assert idle == pytest.approx({"a": 0.01, "b": 0.0})  # CPU seconds over the 3 s wait
    assert [(r["config"], r["prompt"], r["round"]) for r in results][:2] == [("a", "code/p0", 0), ("b", "code/p0", 0)]


def test_a_suite_given_as_a_file_is_named_after_it_in_the_tables(tmp_path):
    """--suites path/long.jsonl: the prompts' suite is "long", and so are the tables' columns (they
    were keyed by the path and came out empty)."""
    path = tmp_path / "long.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n'
                    '{"id": "b", "prompt": "y"}\n')
    suites, prompts = nl.suite_prompts(f"code,{path}", 1)
    assert suites == ["code", "long"] and [p.suite for p in prompts] == ["code", "long"]
    results = [{"config": c, "prompt": f"{p.suite}/{p.id}", "suite": p.suite, "round": 0, "tok_s": t, "text": "t",
                "decode_tok_s": t} for p in prompts for c, t in (("llama.cpp plain", 10.0), ("specserve plain", 20.0))]
    rows = nl.summarize(results, ["llama.cpp plain", "specserve plain"], suites)
    text = nl.markdown(rows, argparse.Namespace(model="m", tokens=8, rounds=1, limit=1))
    assert "| configuration | code | long | same text as its plain |" in text
    assert "| specserve plain | 20.0 (2.00x) | 20.0 (2.00x) | 2/2 |" in text
