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


def test_gguf_of_an_unknown_version_or_not_gguf(tmp_path, smol_path):
    """Both were reported as "corrupt or truncated"; the error now says what the file is."""
    head = smol_path.read_bytes()[:1_000_000]
    future = tmp_path / "future.gguf"
    future.write_bytes(head[:4] + (99).to_bytes(4, "little") + head[8:])
    assert_clean_error(run_cli("generate", "--model", str(future), "hi"), "GGUF version 99 is not supported",
                       "versions 2, 3")
    other = tmp_path / "weights.gguf"
    other.write_bytes(b"PK\x03\x04" + head[4:])
    assert_clean_error(run_cli("generate", "--model", str(other), "hi"), "is not a GGUF file")


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


def test_generate_default_length_fits_a_short_context_and_reads_stdin():
    """Without --max-tokens, a short --max-model-len caps the default 256 to what the prompt leaves
    (it was an error naming max_tokens); "-" reads the prompt from standard input; -1 runs to the
    end of the context."""
    proc = subprocess.run([sys.executable, "-m", "specserve", "generate", "--json", "--max-model-len", "64",
                           "--ignore-eos", "-"], input="Count from 1 to 100.", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    usage = json.loads(proc.stdout)["usage"]
    assert usage["prompt_tokens"] > 5 and usage["prompt_tokens"] + usage["completion_tokens"] == 64
    proc = run_cli("generate", "--json", "--max-model-len", "300", "--max-tokens", "-1", "--ignore-eos", "Hi")
    usage = json.loads(proc.stdout)["usage"]  # llama-cli's -n -1: to the end of the context
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 300


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


# ---------------------------------------------------------------- flags checked before any work

@pytest.mark.parametrize("argv,words", [
    (["plan", "--threads=-1"], ["--threads", "[0, 1024]"]),
    (["plan", "--gpu-memory-utilization=nan"], ["--gpu-memory-utilization", "(0, 1]"]),
    (["plan", "--memory", "99999999999999999999999"], ["--memory", "1 PiB"]),
    (["plan", "--kv-cache-memory", "lots"], ["--kv-cache-memory", "not a byte count"]),
    (["serve", "--port=70000"], ["--port", "[0, 65535]"]),
    (["train-drafter", "--method", "dflash", "--out", "x", "--layers", "0"], ["--layers", "[1, 5]"]),
    (["train-drafter", "--method", "dflash", "--out", "x", "--gen-batch", "0"], ["--gen-batch", ">= 1"]),
    (["train-drafter", "--method", "dflash", "--out", "x", "--temperature", "-1"], ["--temperature", ">= 0"]),
])
def test_bad_numbers_are_usage_errors(argv, words, capsys):
    """argparse refuses them (exit 2) instead of a traceback after the model loaded (they were:
    set_num_threads, int(nan), bind(), a 0-layer drafter)."""
    from specserve.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("make_argv,words", [
    (lambda d: ["lock", "--out", str(d), "--", "--model", "smollm2-135m"], ["--out", "directory"]),
    (lambda d: ["bench", "--url", "http://127.0.0.1:9", "--limit", "0"], ["--limit"]),
    (lambda d: ["bench", "--url", "http://127.0.0.1:9", "--chart", str(d / "c.txt")], ["--chart", ".png"]),
    (lambda d: ["bench", "--url", "http://127.0.0.1:9", "--out", str(d / "no" / "r.json")], ["--out"]),
    (lambda d: ["bench", "--url", "http://127.0.0.1:9", "--limit", "1"], ["Connection refused"]),
    (lambda d: ["train-drafter", "--method", "dflash", "--out", str(d), "--resume"], ["--resume", "checkpoint"]),
    (lambda d: ["train-drafter", "--method", "dflash", "--out", str(d), "--data", "stdlib:-5"], ["stdlib:-5"]),
])
def test_bad_paths_and_values_fail_before_any_work(make_argv, words, tmp_path, capsys):
    from specserve.cli import main

    assert main(make_argv(tmp_path)) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), lines
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_speculative_config_null_means_default():
    from specserve.errors import SpecserveError
    from specserve.speculative.config import parse_speculative_config

    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": null, "prompt_lookup_max": null}')
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max) == (5, 5)
    for bad, word in [('{"method": null}', "method"), ('{"method": "ngram", "model": "x"}', "ngram")]:
        with pytest.raises(SpecserveError, match=word):
            parse_speculative_config(bad)


def test_speculative_config_without_method_reads_it_from_model_as_vllm_does():
    from specserve.errors import SpecserveError
    from specserve.speculative.config import parse_speculative_config

    spec = parse_speculative_config('{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5}')
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "qwen2.5-coder-0.5b", 5)
    spec = parse_speculative_config('{"model": "[ngram]", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (spec.method, spec.model, spec.prompt_lookup_max) == ("ngram", None, 3)
    chain = parse_speculative_config({"method": "chain", "drafters": [{"method": "suffix"}, {"model": "x"}]})
    assert [d.method for d in chain.drafters] == ["suffix", "draft_model"]
    with pytest.raises(SpecserveError, match="missing key 'method'"):
        parse_speculative_config('{"num_speculative_tokens": 4}')


def test_a_drafter_given_as_the_model_is_named_as_one():
    """It said "unsupported architecture '' in config.json"."""
    assert_clean_error(run_cli("generate", "--model", "smollm2-135m-dflash", "hi"), "dflash drafter for smollm2-135m")


def test_kv_cache_dtype_takes_vllms_spellings():
    """vLLM's --kv-cache-dtype fp8 (e4m3) and the long dtype names mean our short ones."""
    from specserve.commands.args import build_serve_parser

    parse = build_serve_parser().parse_args
    got = [parse(["--kv-cache-dtype", v]).kv_cache_dtype for v in ("fp8", "bfloat16", "float16", "int8")]
    assert got == ["fp8_e4m3", "bf16", "fp16", "int8"]


def test_chat_template_from_a_file_or_inline(tmp_path):
    """--chat-template takes a file, or the template itself inline (vLLM's single-line form); an empty
    value and a missing file that is no template are errors naming the flag."""
    from specserve.errors import SpecserveError
    from specserve.server.config import read_chat_template

    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert read_chat_template(inline) == inline
    (tmp_path / "t.jinja").write_text(inline)
    assert read_chat_template(str(tmp_path / "t.jinja")) == inline
    for bad, message in (("", "an empty value"), (str(tmp_path / "none.jinja"), "cannot read --chat-template")):
        with pytest.raises(SpecserveError, match=message):
            read_chat_template(bad)


def test_api_key_from_the_environment(monkeypatch):
    """--api-key defaults to $SPECSERVE_API_KEY (kept out of ps, as vLLM's $VLLM_API_KEY); the flag wins."""
    from specserve.commands.args import build_serve_parser

    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env")
    assert build_serve_parser().parse_args([]).api_key == ["from-env"]
    assert build_serve_parser().parse_args(["--api-key", "flag"]).api_key == ["flag"]
    assert build_serve_parser().parse_args(["--api-key", "a", "b"]).api_key == ["a", "b"]
    monkeypatch.delenv("SPECSERVE_API_KEY")
    assert build_serve_parser().parse_args([]).api_key is None


def test_api_keys_from_flags_and_a_file(tmp_path):
    """vLLM's --api-key A B, llama-server's A,B and --api-key-file (one a line, # comments);
    an empty key or an empty file refuses to start rather than serving everyone."""
    from specserve.errors import SpecserveError
    from specserve.server.config import read_api_keys

    f = tmp_path / "keys"
    f.write_text("# team keys\nk3\n\n  k4  \n#k5\n")
    assert read_api_keys(["k1,k2", "k3"], str(f)) == ("k1", "k2", "k3", "k4")
    assert read_api_keys(None, None) == ()
    assert read_api_keys("one", None) == ("one",)
    (tmp_path / "empty").write_text("# nothing\n\n")
    for values, path, message in (([""], None, "holds an empty key"), (["a,"], None, "holds an empty key"),
                                  (None, str(tmp_path / "none"), "cannot read --api-key-file"),
                                  (None, str(tmp_path / "empty"), "holds no key")):
        with pytest.raises(SpecserveError, match=message):
            read_api_keys(values, path)


def test_an_unknown_flag_is_named_by_its_command(capsys):
    """argparse names an unknown flag at the top level (its usage: COMMAND ...); the command's own
    usage says which flags it takes."""
    from specserve.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plan", "--bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "specserve plan: error: unrecognized arguments: --bogus" in err
    assert err.startswith("usage: specserve plan")


def test_the_served_url_as_a_client_writes_it():
    from specserve.commands.serve import url_of

    assert url_of("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert url_of("::1", 8000) == "http://[::1]:8000"
    assert url_of("", 8000).startswith("http://0.0.0.0:8000")


def test_a_missing_mmproj_is_named_first(capsys, tmp_path):
    """--mmproj FILE that is not there says so, before any question about the model's vocabulary."""
    from specserve.cli import main

    missing = str(tmp_path / "mmproj.gguf")
    assert main(["generate", "--mmproj", missing, "--max-tokens", "1", "hi"]) == 1
    assert f"--mmproj {missing}: no such file" in capsys.readouterr().err


def test_help_names_defaults(capsys):
    """A command's --help names each flag's default, as vLLM's and llama-server's do; unset ones and
    flags whose help already says their default are left as written."""
    from specserve.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 0)", "(default: smollm2-135m)"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: the model's)") == 1  # --max-model-len's own words, nothing appended
