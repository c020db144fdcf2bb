"""Deployment locks: ``specserve lock`` / ``specserve verify`` and the serve-side API."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest

from specserve.cli import main
from specserve.lock import check_lock, fingerprint, format_drifts, hashcache, verify_or_exit
from specserve.lock.compare import is_allowed
from specserve.lock.fingerprint import parse_serve_args, redact_argv

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"


def write_gguf(path: Path, template: str = TEMPLATE, tokens: tuple[str, ...] = ("a", "b", "c")) -> Path:
    """A tiny but real GGUF: tokenizer fields, a chat template and one tensor."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(tokens))
    w.add_chat_template(template)
    w.add_tensor("tok_embd.weight", np.arange(64, dtype=np.float32).reshape(4, 16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def set_fake_pkg(site: Path, version: str) -> None:
    """(Re)install the distribution ``fake_pkg`` at ``version`` in ``site``."""
    for old in site.glob("fake_pkg-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"fake_pkg-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake_pkg\nVersion: {version}\n")
    importlib.invalidate_caches()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Isolated hash cache, a fake site dir with fake_pkg 1.0, two small 'native libraries', a tiny GGUF."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    for var in fingerprint.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    set_fake_pkg(site, "1.0")
    libs = {}
    for name in ("libc10.so", "libtorch_cpu.so"):
        (tmp_path / name).write_bytes(name.encode() * 100)
        libs[f"torch/lib/{name}"] = tmp_path / name
    monkeypatch.setattr(fingerprint, "native_libraries", lambda: dict(libs))
    model = write_gguf(tmp_path / "tiny.gguf")
    draft = write_gguf(tmp_path / "draft.gguf", tokens=("a", "b", "c", "d"))
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)

    class Env:
        pass

    e = Env()
    e.tmp, e.site, e.model, e.draft, e.template, e.libs = tmp_path, site, model, draft, template, libs
    e.lock = str(tmp_path / "deploy.lock")
    e.args = ["--model", str(model)]
    return e


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def lock(capsys, e, *serve_args: str) -> None:
    rc, out, err = run(capsys, "lock", "--out", e.lock, "--", *(serve_args or e.args))
    assert rc == 0, err
    assert f"wrote {e.lock}" in out


def drift_lines(out: str) -> dict[str, str]:
    """``field -> 'old -> new'`` from verify's output."""
    return dict(line.split(": ", 1) for line in out.splitlines()[1:] if not line.startswith("  "))


def test_unchanged_deployment_verifies_clean(capsys, env):
    lock(capsys, env)
    data = json.loads(Path(env.lock).read_text())
    fp = data["fingerprint"]
    assert fp["packages"]["fake-pkg"] == "1.0"
    assert set(fp["native"]) == {"torch/lib/libc10.so", "torch/lib/libtorch_cpu.so"}
    assert fp["model"]["files"]["tiny.gguf"]["size"] == env.model.stat().st_size
    assert fp["chat_template"]["source"] == "gguf:tokenizer.chat_template"
    assert fp["serve"]["max_num_seqs"] == 8 and "lock" not in fp["serve"] and "lock_allow" not in fp["serve"]
    assert fp["device"]["cpu"]["count"] >= 1
    rc, out, _ = run(capsys, "verify", env.lock)
    assert rc == 0
    assert out.startswith("lock OK (") and "fields checked" in out


def test_changed_package_version(capsys, env):
    lock(capsys, env)
    set_fake_pkg(env.site, "1.1")
    rc, out, _ = run(capsys, "verify", env.lock)
    assert rc == 3
    assert drift_lines(out) == {"packages.fake-pkg": "1.0 -> 1.1"}


@pytest.mark.parametrize("rule", ["packages.fake-pkg", "packages.fake_pkg", "packages", "packages.*"])
def test_lock_allow_suppresses_drift(capsys, env, rule):
    lock(capsys, env)
    set_fake_pkg(env.site, "1.1")
    rc, out, _ = run(capsys, "verify", env.lock, "--lock-allow", rule)
    assert rc == 0
    assert "lock OK" in out and "1 allowed to drift" in out


@pytest.mark.parametrize("rule", ["packages.fake-pkgg", "serve.max-num-seq", "model.nme"])
def test_lock_allow_rule_that_matches_nothing_is_an_error(capsys, env, rule):
    """A typo in --lock-allow would silently allow nothing: refused, naming the rule."""
    lock(capsys, env)
    rc, _, err = run(capsys, "verify", env.lock, "--lock-allow", rule)
    assert rc == 1 and rule in err and "matches no field" in err


def test_edited_chat_template(capsys, env):
    lock(capsys, env, *env.args, "--chat-template", str(env.template))
    env.template.write_text(TEMPLATE + "{{ '<|assistant|>' }}")
    rc, out, _ = run(capsys, "verify", env.lock)
    assert rc == 3
    assert list(drift_lines(out)) == ["chat_template.sha256"]


def test_changed_embedded_chat_template(capsys, env):
    lock(capsys, env)
    write_gguf(env.model, template=TEMPLATE + "!")
    rc, out, _ = run(capsys, "verify", env.lock)
    assert rc == 3
    assert "chat_template.sha256" in drift_lines(out)
    assert "tokenizer.sha256" not in drift_lines(out)


def test_truncated_model_file(capsys, env):
    lock(capsys, env)
    size = env.model.stat().st_size
    with open(env.model, "r+b") as f:
        f.truncate(size - 64)
    rc, out, _ = run(capsys, "verify", env.lock)
    assert rc == 3
    lines = drift_lines(out)
    assert lines["model.files.tiny.gguf.size"] == f"{size} -> {size - 64}"
    assert "model.files.tiny.gguf.sha256" in lines


def test_a_model_that_is_gone_is_named_first(capsys, env):
    """Its dependent fields (files, tokenizer, template) drift too; the cause heads the report."""
    lock(capsys, env)
    gone = str(env.tmp / "gone.gguf")
    rc, out, _ = run(capsys, "verify", env.lock, "--", "--model", gone)
    assert rc == 3
    head, cause = out.splitlines()[:2]
    assert head.endswith("; 1 could not be checked:")
    assert cause.startswith(f"  cannot resolve model '{gone}'")
    assert drift_lines(out)["serve.model"] == f"{env.model} -> {gone}"


def test_changed_flag(capsys, env):
    lock(capsys, env, *env.args, "--max-num-seqs", "4")
    rc, out, _ = run(capsys, "verify", env.lock)  # stored serve args
    assert rc == 0
    rc, out, _ = run(capsys, "verify", env.lock, "--", *env.args, "--max-num-seqs", "6")
    assert rc == 3
    assert drift_lines(out) == {"serve.max_num_seqs": "4 -> 6"}


def test_equivalent_json_flags_are_no_drift(capsys, env):
    """A JSON flag spelled another way (spacing, key order, a default written out) is the same
    setting; a different config is drift, named in its one spelling."""
    lock(capsys, env, *env.args, "--speculative-config", '{"method": "ngram"}',
         "--default-chat-template-kwargs", '{"b": 1, "a": 2}')
    same = ['{"num_speculative_tokens":5,"method":"ngram"}', '{"a":2,"b":1}']
    rc, out, _ = run(capsys, "verify", env.lock, "--", *env.args, "--speculative-config", same[0],
                     "--default-chat-template-kwargs", same[1])
    assert rc == 0, out
    rc, out, _ = run(capsys, "verify", env.lock, "--", *env.args, "--speculative-config", '{"method": "suffix"}',
                     "--default-chat-template-kwargs", same[1])
    assert rc == 3 and list(drift_lines(out)) == ["serve.speculative_config"], out


@pytest.mark.parametrize("flags, word", [(["--max-num-seqs", "0"], "--max-num-seqs"),
                                         (["--max-model-len", "-3"], "--max-model-len"),
                                         (["--speculative-config", '{"method": "ngram", "bogus": 1}'], "bogus")])
def test_lock_refuses_what_serve_refuses(capsys, env, flags, word):
    rc, _, err = run(capsys, "lock", "--out", env.lock, "--", *env.args, *flags)
    assert rc != 0 and word in err and "Traceback" not in err
    assert not Path(env.lock).exists()


def test_changed_drafter_file(capsys, env):
    spec = json.dumps({"method": "draft_model", "model": str(env.draft), "num_speculative_tokens": 4})
    lock(capsys, env, *env.args, "--speculative-config", spec)
    fp = json.loads(Path(env.lock).read_text())["fingerprint"]
    assert "draft.gguf" in fp["drafter"]["files"]
    with open(env.draft, "ab") as f:
        f.write(b"\0" * 32)
    rc, out, _ = run(capsys, "verify", env.lock)
    assert rc == 3
    assert set(drift_lines(out)) == {"drafter.files.draft.gguf.sha256", "drafter.files.draft.gguf.size"}


def test_hf_directory_template_and_tokenizer(capsys, env):
    d = env.tmp / "hfmodel"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "tokenizer.json").write_text('{"model": {}}')
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    lock(capsys, env, "--model", str(d))
    fp = json.loads(Path(env.lock).read_text())["fingerprint"]
    assert fp["chat_template"]["source"] == "tokenizer_config.json"
    assert set(fp["tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE + "!"}))
    rc, out, _ = run(capsys, "verify", env.lock)
    assert rc == 3
    assert {"chat_template.sha256", "tokenizer.files.tokenizer_config.json.sha256",
            "model.files.tokenizer_config.json.sha256"} <= set(drift_lines(out))


@pytest.mark.parametrize("content, message", [
    ("{not json", "invalid JSON at line 1"),
    ('{"format": "specserve-lock", "format_version": 1, "serve_argv": []}', "missing or invalid 'fingerprint'"),
    ('{"format": "specserve-lock", "format_version": 99}', "format version 99"),
    ("[1, 2]", "not a specserve lock file"),
])
def test_corrupt_lock_is_one_line_error(capsys, env, content, message):
    Path(env.lock).write_text(content)
    rc, out, err = run(capsys, "verify", env.lock)
    assert rc == 1
    assert err.startswith("error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_missing_lock_file(capsys, env):
    rc, _, err = run(capsys, "verify", str(env.tmp / "nope.lock"))
    assert rc == 1 and "not found" in err


def test_hash_cache_skips_rehash_and_full_rehashes(capsys, env, monkeypatch):
    monkeypatch.setattr(hashcache, "CACHE_MIN_BYTES", 0)
    calls: list[Path] = []
    real = hashcache.sha256_file

    def counting(path):
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(hashcache, "sha256_file", counting)
    lock(capsys, env)
    hashed = {p.name for p in calls}
    assert {"tiny.gguf", "libc10.so", "libtorch_cpu.so"} <= hashed
    calls.clear()
    assert run(capsys, "verify", env.lock)[0] == 0
    assert calls == []
    assert run(capsys, "verify", env.lock, "--full")[0] == 0
    assert {p.name for p in calls} == hashed and len(calls) == len(hashed)
    assert (env.tmp / "cache" / "hashcache.json").is_file()


def test_hash_cache_notices_changed_file(env, monkeypatch):
    monkeypatch.setattr(hashcache, "CACHE_MIN_BYTES", 0)
    f = env.tmp / "weights.bin"
    f.write_bytes(b"x" * 1000)
    cache = hashcache.HashCache()
    first = cache.sha256(f)
    cache.save()
    f.write_bytes(b"y" * 1001)
    assert hashcache.HashCache().sha256(f) != first


def test_update_reports_change_and_next_verify_is_clean(capsys, env):
    lock(capsys, env)
    set_fake_pkg(env.site, "1.1")
    rc, out, _ = run(capsys, "lock", "--update", "--out", env.lock)
    assert rc == 0
    assert "packages.fake-pkg: 1.0 -> 1.1" in out.splitlines()
    assert "1 field(s) changed" in out
    rc, out, _ = run(capsys, "verify", env.lock)
    assert rc == 0 and "lock OK" in out
    rc, out, _ = run(capsys, "lock", "--update", "--out", env.lock, "--", *env.args, "--max-num-seqs", "2")
    assert rc == 0 and "serve.max_num_seqs: 8 -> 2" in out
    assert json.loads(Path(env.lock).read_text())["serve_argv"][-1] == "2"
    assert run(capsys, "verify", env.lock)[0] == 0


def test_serve_api(capsys, env):
    lock(capsys, env, *env.args, "--api-key", "s3cret")
    assert "s3cret" not in Path(env.lock).read_text()
    drifts = check_lock(env.lock, None, [])
    assert drifts == [] and drifts.checked > 10
    assert format_drifts(drifts) == f"lock OK ({drifts.checked} fields checked)"
    ns = parse_serve_args([*env.args, "--api-key", "s3cret", "--lock", env.lock])
    verify_or_exit(env.lock, [], ns)
    ns = parse_serve_args([*env.args, "--api-key", "other"])
    with pytest.raises(SystemExit) as exc:
        verify_or_exit(env.lock, [], ns)
    assert exc.value.code == 3
    assert "serve.api_key: sha256:" in capsys.readouterr().err
    verify_or_exit(env.lock, ["serve.api-key"], ns)


def test_allow_rules_and_redaction():
    assert is_allowed("packages.numpy", ["packages"])
    assert is_allowed("packages.fake-pkg", ["packages.Fake_Pkg"])
    assert is_allowed("model.files.a.gguf.sha256", ["model.files.*.sha256"])
    assert is_allowed("serve.max_num_seqs", ["serve.max-num-seqs"])
    assert not is_allowed("packages.numpy", ["packages.num"])
    assert not is_allowed("packagesx.numpy", ["packages"])
    assert redact_argv(["--api-key", "k", "--api-key=k2", "--port", "1"]) == \
        ["--api-key", "<redacted>", "--api-key=<redacted>", "--port", "1"]
    assert redact_argv(["--api-key", "a", "b", "--port", "1", "--api-key", "c"]) == \
        ["--api-key", "<redacted>", "<redacted>", "--port", "1", "--api-key", "<redacted>"]


@pytest.mark.parametrize("flags, message", [(["--lock", ""], "--lock: an empty path"),
                                            (["--lock", " "], "--lock: an empty path"),
                                            (["--lock-allow", "kernels"], "--lock-allow applies to --lock")])
def test_serve_refuses_a_lock_flag_that_checks_nothing(capsys, flags, message):
    """serve --lock "$UNSET" would start without its drift check: an empty path is an error, and so is
    --lock-allow without --lock (both before anything loads)."""
    rc, _, err = run(capsys, "serve", *flags)
    assert rc == 1 and message in err and "Traceback" not in err
