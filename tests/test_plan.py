"""``specserve plan``: the planner's numbers are the pool the engine really allocates."""

import json
import logging

import pytest

from engine_utils import make_engine
from specserve import cli
from specserve.commands.plan import format_plan, parse_bytes
from specserve.errors import SpecserveError

MODEL = ("--model", "smollm2-135m")


def plan_json(capsys, *argv: str) -> dict:
    return plan_json_for(capsys, MODEL[1], *argv)


def plan_json_for(capsys, model: str, *argv: str) -> dict:
    assert cli.main(["plan", "--model", model, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check_engine_matches(engine, got: dict) -> None:
    plan = engine.plan
    assert got["num_blocks"] == plan.num_blocks == engine.blocks.num_blocks
    assert got["kv_bytes_per_token"] == plan.kv_bytes_per_token
    assert got["weight_bytes"] == plan.weight_bytes == engine.model.weight_bytes()
    assert got["drafter_bytes"] == plan.drafter_bytes
    assert got["kv_cache_dtype"] == plan.kv_dtype == engine.kv.kv_dtype
    # the tensors the engine allocated are exactly the planned pool
    assert engine.kv.k[0].shape[0] == got["num_blocks"]
    assert engine.kv.nbytes() == got["pool_bytes"] == plan.pool_bytes
    assert got["concurrency_at_max_model_len"] == plan.concurrency_at(plan.max_model_len)


@pytest.mark.parametrize("dtype", ["auto", "int8", "int4"])
def test_plan_equals_engine_allocation(capsys, dtype):
    flags = ("--kv-cache-memory", str(60_000_000), "--kv-cache-dtype", dtype, "--max-model-len", "1024",
             "--block-size", "16")
    got = plan_json(capsys, *flags)
    engine = make_engine(*MODEL, *flags)
    _check_engine_matches(engine, got)
    assert got["pool_source"] == "--kv-cache-memory"
    assert got["pool_bytes"] <= 60_000_000 < got["pool_bytes"] + 16 * got["kv_bytes_per_token"]


def test_plan_default_sizing_equals_engine(capsys):
    # without --kv-cache-memory the pool is what --max-num-seqs sequences of --max-model-len need
    flags = ("--max-model-len", "512", "--max-num-seqs", "3", "--kv-cache-dtype", "fp8_e4m3")
    got = plan_json(capsys, *flags)
    engine = make_engine(*MODEL, *flags)
    _check_engine_matches(engine, got)
    assert got["num_blocks"] == 3 * 512 // 16 and got["concurrency_at_max_model_len"] == 3


def test_plan_with_draft_model_counts_drafter(capsys):
    spec = '{"method": "draft_model", "model": "smollm2-135m", "quantization": "int8", "num_speculative_tokens": 2}'
    got = plan_json(capsys, "--speculative-config", spec, "--max-model-len", "256", "--kv-cache-memory", "20000000")
    assert got["drafter_bytes"] > 0 and got["speculative_method"] == "draft_model"
    assert got["drafter_kv_bytes"] > 0  # the draft model's own KV pool
    assert got["total_bytes"] == got["weight_bytes"] + got["drafter_bytes"] + got["drafter_kv_bytes"] + got["pool_bytes"]
    engine = make_engine(*MODEL, "--speculative-config", spec, "--max-model-len", "256", "--kv-cache-memory", "20000000")
    assert engine.drafter.kv.nbytes() == got["drafter_kv_bytes"] == engine.plan.drafter_kv_bytes


def test_plan_memory_budget(capsys):
    got = plan_json(capsys, "--memory", "400MiB", "--max-model-len", "1024")
    assert got["pool_source"] == "--memory" and got["memory"] == 400 * 2**20
    per_block = 16 * got["kv_bytes_per_token"]
    assert got["num_blocks"] == (400 * 2**20 - got["weight_bytes"]) // per_block
    assert got["total_bytes"] <= 400 * 2**20
    assert got["max_context"] == 1024
    assert got["concurrency_at_max_model_len"] == got["num_blocks"] // (1024 // 16)


def test_plan_memory_holds_weights_and_a_given_pool(capsys):
    """--memory is weights + KV: a --kv-cache-memory pool that fits only without the weights is refused,
    naming both numbers; one that fits with them is planned."""
    assert cli.main(["plan", "--memory", "400MiB", "--kv-cache-memory", "390MiB", "--max-model-len", "1024"]) == 1
    err = capsys.readouterr().err
    assert "do not fit in --memory 400 MiB" in err and "of weights" in err
    got = plan_json(capsys, "--memory", "400MiB", "--kv-cache-memory", "100MiB", "--max-model-len", "1024")
    assert got["pool_source"] == "--kv-cache-memory" and got["total_bytes"] <= 400 * 2**20


def test_json_shape(capsys):
    got = plan_json(capsys, "--kv-cache-memory", "50000000", "--max-model-len", "1024")
    expected = {"model": str, "device": str, "weight_format": str, "model_max_len": int, "weight_bytes": int,
                "drafter_bytes": int, "kv_cache_dtype": str, "kv_bytes_per_token": int, "block_size": int,
                "num_blocks": int, "pool_tokens": int, "pool_bytes": int, "total_bytes": int, "pool_source": str,
                "available_bytes": int, "max_model_len": int, "max_context": int, "max_num_seqs": int,
                "concurrency_at_max_model_len": int}
    for key, typ in expected.items():
        assert isinstance(got[key], typ), key
    assert got["speculative_method"] is None and got["memory"] is None
    assert got["kv_cache_dtype"] == "fp32" and got["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert got["pool_tokens"] == got["num_blocks"] * 16


def test_refusal_names_the_flag(capsys):
    assert cli.main(["plan", *MODEL, "--kv-cache-memory", "1000000", "--max-model-len", "2048"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "--kv-cache-memory" in err and "--max-model-len" in err
    assert cli.main(["plan", *MODEL, "--memory", "220MiB", "--max-model-len", "8192"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "raise --memory to at least" in err
    with pytest.raises(SpecserveError, match="--kv-cache-memory"):
        make_engine(*MODEL, "--kv-cache-memory", "1000000", "--max-model-len", "2048")


def test_text_output_and_format_plan(capsys):
    assert cli.main(["plan", *MODEL, "--kv-cache-memory", "50000000", "--max-model-len", "1024",
                     "--kv-cache-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "int8, 12,240 bytes/token" in out and "--kv-cache-memory" in out and "max context" in out
    engine = make_engine(*MODEL, "--kv-cache-memory", "50000000", "--max-model-len", "1024", "--kv-cache-dtype", "int8")
    text = format_plan(engine.plan)
    assert len(text.splitlines()) == 3 and text.splitlines()[1:] == out.strip().splitlines()[2:]


def test_parse_bytes():
    assert parse_bytes("123") == 123
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("1.5 MB") == 1_500_000
    with pytest.raises(Exception):
        parse_bytes("lots")


def test_gemma3_counts_only_growing_layers(capsys):
    """gemma3-270m: 3 of its 18 layers are global; the 15 sliding ones keep a 512-token window
    in a fixed pool, so only the global layers count per token."""
    flags = ("--max-model-len", "8192", "--max-num-seqs", "2", "--kv-cache-dtype", "int8")
    got = plan_json_for(capsys, "gemma3-270m", *flags)
    row = 256 + 4  # int8 row of head_dim 256 plus its fp32 scale; 1 kv head
    assert got["kv_bytes_per_token"] == 2 * 3 * row
    assert got["sliding_window"] == 512
    assert got["window_bytes"] == got["window_blocks"] * 16 * 2 * 15 * row
    # two sequences: the window (32 blocks), its partial blocks and a step, plus one 2048-token chunk
    assert got["window_blocks"] == 2 * (32 + 2 + 1) + 2048 // 16
    assert got["num_blocks"] == 2 * 8192 // 16
    engine = make_engine("--model", "gemma3-270m", *flags)
    assert engine.kv.nbytes() == got["pool_bytes"] == engine.plan.pool_bytes
    assert engine.cache.managers[1].pool.num_blocks == got["window_blocks"] and engine.blocks.num_blocks == got["num_blocks"]
    assert cli.main(["plan", "--model", "gemma3-270m", *flags]) == 0
    assert "sliding-window layers: window 512 tokens" in capsys.readouterr().out


def test_max_model_len_above_the_models_is_capped_with_a_warning(capsys, caplog):
    """Serve, generate and plan build through one place (builder.build_parts), which says so."""
    log = logging.getLogger("specserve.engine")
    log.addHandler(caplog.handler)  # also when another test turned off propagation to the root logger
    try:
        assert cli.main(["plan", *MODEL, "--max-model-len", "100000", "--json"]) == 0
    finally:
        log.removeHandler(caplog.handler)
    assert json.loads(capsys.readouterr().out)["max_model_len"] == 8192
    assert "--max-model-len 100000 is more than smollm2-135m was trained for; using 8192" in caplog.text


def test_cpu_plan_counts_loaded_weights_once():
    """On the CPU the available memory is read with the weights loaded: a 2 GiB pool fits in
    3 GiB left after 1 GiB of weights (they were counted twice once, refusing a fitting engine),
    while buffers allocated later (drafter KV, vision activations) still count against it."""
    from specserve.engine.config import EngineConfig, plan_memory

    MiB = 1 << 20
    ecfg = EngineConfig(max_model_len=1024, kv_cache_memory=2048 * MiB)
    plan = plan_memory(ecfg, 4096, 1024, 1024 * MiB, 0, 3072 * MiB, "cpu")
    assert plan.num_blocks == 2048 * MiB // (16 * 4096)
    with pytest.raises(SpecserveError, match=r"KV pool \(2048 MiB\) plus 1536 MiB of drafter KV and vision"):
        plan_memory(ecfg, 4096, 1024, 1024 * MiB, 0, 3072 * MiB, "cpu", drafter_kv_bytes=512 * MiB,
                    vision=(100 * MiB, 512 * MiB, 512 * MiB))
    auto = plan_memory(EngineConfig(max_model_len=1024), 4096, 1024, 1024 * MiB, 0, 3072 * MiB, "cpu",
                       vision=(100 * MiB, 512 * MiB, 512 * MiB))  # the pool sized around them
    assert auto.num_blocks * 16 * 4096 <= int(3072 * MiB * 0.9) - 1024 * MiB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_cpu_kv_pool_is_committed_as_it_is_written():
    """The README's claim: a CPU pool costs no memory (and no start-up time) until sequences
    write it, and reads as zeros."""
    import torch

    from specserve.models.kv_cache import zeros

    before = _rss()
    pool = zeros((2048, 16, 8, 512), torch.float32, torch.device("cpu"))  # 512 MiB
    assert pool.shape == (2048, 16, 8, 512) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert _rss() - before < 64 << 20
    assert not pool[::97].any()
    pool[:256] = 1.0  # an eighth of it written: that much is committed
    assert 48 << 20 < _rss() - before < 192 << 20
    assert zeros((0, 16, 8, 64), torch.bfloat16, torch.device("cpu")).shape == (0, 16, 8, 64)
