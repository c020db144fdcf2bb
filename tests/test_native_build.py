"""benchmarks/native_llamacpp.py's llama.cpp build: reused on the CPU it was built for, rebuilt
from scratch on another (its objects are -march=native; cmake alone would only relink them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import native_llamacpp as nl  # noqa: E402


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
