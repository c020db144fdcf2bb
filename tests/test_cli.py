"""The CLI on bad input: one line naming the problem, non-zero exit, no traceback."""

import json
import subprocess
import sys

import numpy as np
import pytest

from specserve.models.catalog import resolve_model


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_clean_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def smol_path():
    return resolve_model("smollm2-135m").path


def _write_gguf(path, arch: str, qtype=None) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    else:
        size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor("token_embd.weight", np.zeros((16, 256 // size[0] * size[1]), dtype=np.uint8),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_catalog_name():
    assert_clean_error(run_cli("generate", "--model", "no-such-model", "hi"), "unknown model", "no-such-model")


def test_truncated_gguf(tmp_path, smol_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(smol_path.read_bytes()[:30_000_000])
    assert_clean_error(run_cli("generate", "--model", str(bad), "hi"), "truncated")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    assert_clean_error(run_cli("generate", "--model", str(bad), "hi"))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, "mamba")
    assert_clean_error(run_cli("generate", "--model", str(path), "hi"), "unsupported architecture", "mamba")


def test_unsupported_quant_type(tmp_path):
    import gguf

    path = tmp_path / "iq.gguf"
    _write_gguf(path, "llama", gguf.GGMLQuantizationType.IQ2_XXS)
    assert_clean_error(run_cli("generate", "--model", str(path), "hi"), "unsupported", "IQ2_XXS")


def test_prompt_longer_than_context():
    proc = run_cli("generate", "--max-model-len", "32", "word " * 100)
    assert_clean_error(proc, "maximum context length is 32")


def test_bad_speculative_config_names_the_key():
    assert_clean_error(run_cli("generate", "--speculative-config", '{"method": "ngram", "bogus": 1}', "hi"),
                       "bogus")


def test_generate_json_reports_tokens_timings_and_speculation():
    proc = run_cli("generate", "--json", "--max-tokens", "12", "--speculative-config",
                   '{"method": "ngram", "num_speculative_tokens": 4}', "Count from 1 to 20.")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["usage"]["completion_tokens"] == len(obj["token_ids"]) <= 12
    assert obj["timings"]["decode_tokens_per_s"] > 0 and "speculative" in obj
    assert obj["text"].strip()


def test_model_without_chat_template_falls_back_with_a_warning():
    proc = run_cli("generate", "--model", "gemma3-270m", "--max-tokens", "4", "The sky is")
    assert proc.returncode == 0, proc.stderr
    assert "no chat template" in proc.stderr
