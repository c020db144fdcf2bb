"""Tensor parallel over gloo on this machine: two ranks, one thread each (specserve/parallel).

A tiny random Llama at fp32: logits against the same model on one rank, greedy tokens with and
without every drafter (exact: the all-reduce adds partial sums in another order than one rank,
but the same order at every step, in every batch), alone and in a batch of 8; the shards
rebuild the full matrices; the wire format; two "nodes" on loopback; bad flags. The real-model
agreement count and a killed rank are in tests/test_tensor_parallel_live.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine_utils import drafter_makers, run_all
from specserve.commands.args import add_engine_args
from specserve.engine.builder import build_parts
from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.errors import SpecserveError
from specserve.models.loader import load_model
from specserve.models.transformer import ForwardBatch, Paging
from specserve.bench.serverproc import free_port
from specserve.parallel.launch import ParallelConfig, stop_workers
from specserve.parallel.shard import Shard, shard_tensors, split_points, vocab_rows
from tiny_models import FP32, make_tiny_target

MAX_LEN = 256


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def tp_args(directory, *extra: str) -> argparse.Namespace:
    return parse("--model", str(directory), "--quantization", "none", "--max-model-len", str(MAX_LEN),
                 "--kv-cache-memory", "16MiB", "-tp", "2", "--threads", "1", *extra)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_tiny")
    make_tiny_target(d)
    return d


@pytest.fixture(scope="module")
def one(tiny_dir):
    return load_model(str(tiny_dir), FP32)


@pytest.fixture(scope="module")
def tp2(tiny_dir):
    """The tiny target split over 2 ranks: this process is rank 0, a worker process rank 1."""
    parts = build_parts(tp_args(tiny_dir))
    yield parts.target
    stop_workers(parts.target.model.tp)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tp_draft"), seed=1, layers=1)


def prompts(n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 250, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
            + [5, 6, 7, 5, 6, 7] for _ in range(n)]


def engine(target, spec=None, drafter=None, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("kv_cache_memory", 16 << 20)
    return LLMEngine(target, EngineConfig(**kw), spec, drafter)


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_logits_agree_with_one_rank(one, tp2):
    ids = prompts(1)[0]
    got = [run_logits(m, ids) for m in (one, tp2)]
    assert got[0].shape == got[1].shape == (len(ids), one.config.vocab_size)
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4)


def run_logits(target, ids: list[int]) -> torch.Tensor:
    from engine_utils import logits_of_every_position

    eng = engine(target)
    eng.add_request("x", ids, SamplingParams(max_tokens=1))
    return logits_of_every_position(eng, "x")[0][:len(ids)]


def test_prompt_logprobs_agree_with_one_rank(one, tp2):
    ids = prompts(1)[0]
    got = []
    for target in (one, tp2):
        outs = list(engine(target).generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=1), request_id="pl"))
        lps = outs[-1].prompt_logprobs
        assert lps[0] is None and [lp.token_id for lp in lps[1:]] == ids[1:]
        got.append(torch.tensor([lp.logprob for lp in lps[1:]]))
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4)


def test_greedy_is_deterministic_and_batch_invariant(one, tp2):
    ps = prompts()
    batch = run_all(engine(tp2), ps, GREEDY)
    assert run_all(engine(tp2), ps, GREEDY) == batch  # run to run
    assert [run_all(engine(tp2, max_num_seqs=1), [p], GREEDY)[0] for p in ps[:3]] == batch[:3]  # alone
    single = run_all(engine(one), ps, GREEDY)
    same = sum(a[:16] == b[:16] for a, b in zip(batch, single))
    assert same >= 6, f"only {same} of 8 prompts keep one rank's first 16 tokens"


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "dflash"])
def test_every_drafter_is_lossless_under_tensor_parallel(tiny_dir, tp2, draft, method):
    ps = prompts()
    plain = run_all(engine(tp2), ps, GREEDY)
    spec, drafter = drafter_makers(tiny_dir, tp2, draft, MAX_LEN)[method]()
    eng = engine(tp2, spec, drafter)
    assert run_all(eng, ps, GREEDY) == plain
    assert eng.totals.draft_tokens > 0


def test_mtp_head_under_tensor_parallel(tmp_path, one, tp2):
    """A (random) MTP head reads the target's last hidden state and its embedding / LM head,
    both split over the ranks: the driver's calls into them run on every rank."""
    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.drafter_files import save_drafter
    from specserve.speculative.registry import build_drafter
    from specserve.speculative.train.trainer import make_model
    from specserve.models.loader import LoadOptions

    head = make_model("mtp", one, seed=3)
    save_drafter(head, head.cfg.to_json(), tmp_path / "mtp")
    spec = SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False, model=str(tmp_path / "mtp"))
    options = LoadOptions("cpu", "float32", "none")
    ps = prompts()
    plain = run_all(engine(tp2), ps, GREEDY)
    eng = engine(tp2, spec, build_drafter(spec, tp2, options, EngineConfig(max_model_len=MAX_LEN), MAX_LEN))
    assert run_all(eng, ps, GREEDY) == plain
    assert eng.totals.draft_tokens > 0


def test_a_cut_of_the_split_lm_head_gives_the_full_heads_logits_at_its_ids(one, tp2):
    """A draft vocabulary's cut of the LM head under tensor parallel: each rank keeps its rows of
    the ids, and the gathered logits are the full head's at those ids, bit for bit (ids on both
    ranks, on one rank only, a cut that replaces another)."""
    model = tp2.model
    h = torch.randn(3, one.config.hidden_size, generator=torch.Generator().manual_seed(5))
    full = model.logits(h)  # [3, V]
    start, _ = vocab_rows(one.config.vocab_size, Shard(1, 2))
    both = torch.tensor([0, 3, 7, start - 1, start, start + 5, one.config.vocab_size - 1])
    cut = model.cut_head(both)
    assert cut.counts == [4, 3]
    assert torch.equal(model.logits(h, cut), full[:, both])
    second = model.cut_head(torch.arange(start, start + 9), replaces=cut)  # rank 0 holds none of these
    assert second.counts == [0, 9] and cut.key not in model.head_cuts
    assert torch.equal(model.logits(h, second), full[:, start:start + 9])


def test_a_dflash_draft_vocabulary_is_lossless_under_tensor_parallel(tmp_path, tiny_dir, tp2):
    """draft_vocab_size with dflash cuts the target's split LM head (it was refused under -tp)."""
    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.dflash import DFlashConfig, DFlashDrafter, DFlashModel
    from specserve.speculative.drafter_files import save_drafter

    m = DFlashModel(DFlashConfig.for_target(tp2, num_layers=1, block_size=4))
    m.init_weights(1.0, tp2.model.final_norm, 0)
    save_drafter(m, m.cfg.to_json(), tmp_path / "d")
    drafter = DFlashDrafter.load(tmp_path / "d", tp2, draft_vocab_size=96)
    assert drafter.vocab is not None and drafter.vocab.vocab == tp2.config.vocab_size
    ps = prompts()
    plain = run_all(engine(tp2), ps, GREEDY)
    eng = engine(tp2, SpeculativeConfig("dflash", num_speculative_tokens=3, adaptive=False, model="x"), drafter)
    assert run_all(eng, ps, GREEDY) == plain
    assert eng.totals.draft_tokens > 0


def test_shards_rebuild_the_full_matrices(one, tiny_dir):
    from specserve.models.loader import _read_hf

    cfg, tensors, _tok, _ = _read_hf(tiny_dir)
    parts = [shard_tensors(cfg, tensors, Shard(r, 2)) for r in range(2)]
    full = {n: t.dequantize() for n, t in tensors.items()}
    for name in ("layers.0.q", "layers.1.k", "layers.2.gate", "embed"):
        torch.testing.assert_close(torch.cat([p[1][name].dequantize() for p in parts]), full[name], rtol=0, atol=0)
    for name in ("layers.0.o", "layers.2.down"):
        torch.testing.assert_close(torch.cat([p[1][name].dequantize() for p in parts], dim=1), full[name],
                                   rtol=0, atol=0)
    rank_cfg = parts[1][0]
    assert (rank_cfg.num_heads, rank_cfg.num_kv_heads, rank_cfg.intermediate_size) == (2, 1, 64)
    torch.testing.assert_close(parts[1][1]["layers.0.attn_norm"].dequantize(), full["layers.0.attn_norm"])


def test_cuts_keep_quantized_blocks_whole():
    assert split_points(4864, 2, 256) == [0, 2304, 4864]  # 19 blocks: 9 and 10, not 2432 (mid-block)
    assert split_points(4864, 2, 32) == [0, 2432, 4864]
    assert split_points(100, 3, 1) == [0, 33, 66, 100]
    assert vocab_rows(151936, Shard(1, 2)) == (75968, 75968)
    assert vocab_rows(10, Shard(2, 3)) == (8, 2)


def test_forward_batch_survives_the_wire_format():
    paging = (Paging(torch.ones(2, 4, dtype=torch.int32), torch.arange(5)),
              Paging(torch.zeros(2, 3, dtype=torch.int32), torch.arange(5, 10)))  # a sliding-window pool of its own
    b = ForwardBatch(torch.arange(5), torch.arange(5, dtype=torch.int32), torch.zeros(5, dtype=torch.int32), paging,
                     torch.tensor([4]), hidden_layers=(0, 2), mm_embeds=torch.randn(2, 8))
    back = ForwardBatch.from_tensors(b.to_tensors())
    assert len(back.paging) == 2
    for p, q in zip(b.paging, back.paging):
        assert torch.equal(p.block_tables, q.block_tables) and torch.equal(p.slot_mapping, q.slot_mapping)
    for name in ForwardBatch.TENSORS:
        a, c = getattr(b, name), getattr(back, name)
        assert (a is None) == (c is None), name
        if a is not None:
            assert a.dtype == c.dtype and torch.equal(a, c), name
    assert back.hidden_layers == (0, 2)


def test_two_nodes_on_loopback_give_the_same_tokens(tiny_dir, tp2):
    """--nnodes 2: node 1 is `specserve serve --node-rank 1` (its worker only), node 0 this process."""
    import subprocess
    import sys

    addr = f"127.0.0.1:{free_port()}"
    node = ["--nnodes", "2", "--dist-init-addr", addr]
    args = tp_args(tiny_dir, *node)
    node1 = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--model", str(tiny_dir),
                              "--quantization", "none", "-tp", "2", "--threads", "1", *node, "--node-rank", "1"])
    try:
        parts = build_parts(args)
        eng = LLMEngine(parts.target, parts.ecfg)
        ps = prompts()
        assert run_all(eng, ps, GREEDY) == run_all(engine(tp2), ps, GREEDY)
        eng.close()
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.parametrize("argv, message", [
    (("-tp", "0"), "must be >= 1"),
    (("-tp", "2", "--nnodes", "3"), "must divide"),
    (("-tp", "2", "--nnodes", "0"), "--nnodes must be >= 1"),
    (("-tp", "2", "--nnodes", "2"), "needs --dist-init-addr"),
    (("-tp", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"), "--node-rank must be in"),
    (("-tp", "2", "--dist-init-addr", "nohost"), "host:port"),
    (("-tp", "2", "--dist-timeout", "0"), "--dist-timeout"),
])
def test_bad_parallel_flags_fail_naming_the_flag(argv, message):
    with pytest.raises(SpecserveError, match=message):
        ParallelConfig.from_args(parse(*argv))


def test_a_model_the_ranks_cannot_split_is_refused_at_start_up():
    with pytest.raises(SpecserveError, match="does not divide the 9 attention heads"):
        build_parts(parse("--model", "smollm2-135m", "-tp", "2", "--max-model-len", "256"))


def test_plan_prints_every_rank_without_starting_one(tiny_dir, one, capsys):
    """Each rank's shard and KV slice; the draft model on rank 0 only; the ranks of one machine
    planned with their share of its memory (--memory here, so the numbers are fixed)."""
    import json

    from specserve import cli

    memory = 64 << 20
    spec = json.dumps({"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 2})
    argv = ["plan", "--model", str(tiny_dir), "--quantization", "none", "--max-model-len", "256",
            "--memory", str(memory), "-tp", "2", "--speculative-config", spec, "--json"]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    ranks = got["ranks"]
    assert len(ranks) == 2 and ranks[0]["num_blocks"] == ranks[1]["num_blocks"]
    assert sum(r["weight_bytes"] for r in ranks) == one.model.weight_bytes()  # split, nothing replicated
    assert ranks[0]["kv_bytes_per_token"] == ranks[1]["kv_bytes_per_token"] == \
        one.model.cfg.num_layers * 2 * one.model.cfg.kv_size * 4 // 2  # half the KV heads each, fp32
    assert ranks[0]["drafter_bytes"] == one.model.weight_bytes() and ranks[1]["drafter_bytes"] == 0
    assert ranks[0]["available_bytes"] == ranks[1]["available_bytes"] == memory // 2
    assert got["total_bytes"] == sum(r["total_bytes"] for r in ranks)


def test_local_ranks_get_cores_of_their_own():
    import os

    sets = ParallelConfig(2).core_sets()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        assert sets == {}
    else:
        assert sorted(sets) == [0, 1] and not set(sets[0]) & set(sets[1])
        assert set(sets[0]) | set(sets[1]) <= set(cores) and sets[0] and sets[1]
    assert ParallelConfig(len(cores) + 1).core_sets() == {}  # fewer cores than ranks: no pinning


# ---- hybrid models: Gated DeltaNet heads and their recurrent states split over the ranks -------
@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    from tiny_models import make_tiny_hybrid

    d = tmp_path_factory.mktemp("tp_hybrid")
    make_tiny_hybrid(d)
    return d


@pytest.fixture(scope="module")
def hybrid_tp2(hybrid_dir):
    parts = build_parts(tp_args(hybrid_dir))
    yield parts.target
    stop_workers(parts.target.model.tp)


def test_hybrid_logits_agree_with_one_rank(hybrid_dir, hybrid_tp2):
    """Each rank's layers in one C call (models/hybrid_fused.py), the row-parallel outputs summed
    over the ranks from inside it."""
    from specserve.models.hybrid_fused import HybridStack

    one = load_model(str(hybrid_dir), FP32)
    assert hybrid_tp2.model.cfg.deltanet.num_v_heads * 2 == one.config.deltanet.num_v_heads
    ids = prompts(1)[0]
    torch.testing.assert_close(run_logits(hybrid_tp2, ids), run_logits(one, ids), rtol=1e-4, atol=1e-4)
    assert isinstance(hybrid_tp2.model._stack, HybridStack) and hybrid_tp2.model._stack.model_desc.m.reduce


@pytest.mark.parametrize("method", ["ngram", "suffix", "mtp"])
def test_hybrid_speculation_is_lossless_with_states_split(hybrid_tp2, method):
    """The checkpoint's own MTP head (built by the registry on the split target, as serve does),
    and model-free drafters: rollback of each rank's state planes stays in step."""
    from specserve.models.loader import LoadOptions
    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.registry import build_drafter

    k = {"ngram": 4, "suffix": 3, "mtp": 3}[method]
    spec = SpeculativeConfig(method, num_speculative_tokens=k, adaptive=False)
    drafter = build_drafter(spec, hybrid_tp2, LoadOptions("cpu", "float32", "none"),
                            EngineConfig(max_model_len=MAX_LEN), MAX_LEN)
    ps = prompts()
    plain = run_all(engine(hybrid_tp2), ps, GREEDY)
    eng = engine(hybrid_tp2, spec, drafter)
    assert run_all(eng, ps, GREEDY) == plain
    assert eng.totals.draft_tokens > 0
    again = run_all(eng, ps, GREEDY)  # prefix-cache hits: each rank restores its state checkpoints
    assert again == plain


def test_mixture_of_experts_splits_every_expert(tmp_path):
    """Qwen3-Next: each expert's and the shared expert's channels split, the router replicated."""
    from tiny_models import make_tiny_qwen3_next

    one, _hf = make_tiny_qwen3_next(tmp_path / "next")
    parts = build_parts(tp_args(tmp_path / "next"))
    try:
        ids = prompts(1)[0]
        torch.testing.assert_close(run_logits(parts.target, ids), run_logits(one, ids), rtol=1e-4, atol=1e-4)
        ps = prompts(4)
        assert run_all(engine(parts.target), ps, GREEDY) == run_all(engine(parts.target, max_num_seqs=1), ps, GREEDY)
    finally:
        stop_workers(parts.target.model.tp)


def test_gguf_hybrid_in_llama_cpp_head_order():
    """llama.cpp's converter tiles the value heads (v head h reads key head h % Hk): each rank keeps
    the value heads of its key heads, wherever they sit."""
    from pathlib import Path

    gguf = str(Path(__file__).resolve().parent / "data" / "tiny_qwen35_vl" / "tiny-qwen35-vl-f32.gguf")
    one = load_model(gguf, FP32)
    assert one.config.deltanet.v_tiled
    parts = build_parts(tp_args(gguf))
    try:
        ids = prompts(1)[0]
        torch.testing.assert_close(run_logits(parts.target, ids), run_logits(one, ids), rtol=1e-4, atol=1e-4)
    finally:
        stop_workers(parts.target.model.tp)


def test_images_under_tensor_parallel():
    """The vision tower runs once, on rank 0 (replicated there, not split; the workers load none):
    the image rows' embeddings and M-RoPE positions travel with the forward to every rank. Greedy
    tokens equal one rank's on this tiny model, and n-gram speculation keeps them exactly."""
    from pathlib import Path

    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.ngram import NgramDrafter
    from test_vision import engine as vl_engine
    from test_vision import greedy, image_prompts

    d = str(Path(__file__).resolve().parent / "data" / "tiny_qwen35_vl" / "hf")
    one = load_model(d, FP32)
    parts = build_parts(tp_args(d, "--max-model-len", "512"))
    try:
        tp = parts.target
        ps = image_prompts(one)[:6]
        plain = greedy(vl_engine(tp), ps, 16)
        assert plain == greedy(vl_engine(one), ps, 16)
        spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
        assert greedy(vl_engine(tp, spec, NgramDrafter(1, 3), max_num_seqs=8), ps, 16) == plain
    finally:
        stop_workers(parts.target.model.tp)


def test_an_idle_group_outlasts_its_collective_timeout(tiny_dir):
    """Workers wait for the next call without a timeout (a server idles for hours); only the
    collectives inside a call have --dist-timeout."""
    import time

    parts = build_parts(tp_args(tiny_dir, "--dist-timeout", "2"))
    try:
        eng = LLMEngine(parts.target, parts.ecfg)
        first = run_all(eng, prompts(2), GREEDY)
        time.sleep(5)
        assert run_all(eng, prompts(2), GREEDY) == first
        assert parts.target.model.tp.failed is None
    finally:
        stop_workers(parts.target.model.tp)


def test_a_driver_error_inside_a_call_breaks_the_group_at_once(tiny_dir):
    """The workers are still inside the call: the ranks are out of step, so the group is broken
    now (the server then exits), not after a collective's timeout."""
    from specserve.parallel.group import Op, ParallelError

    parts = build_parts(tp_args(tiny_dir))
    tp = parts.target.model.tp
    try:
        with pytest.raises(KeyError):
            with tp.lead(Op.EMBED, lambda: [torch.tensor([1, 2])]):
                raise KeyError("boom")
        assert isinstance(tp.failed, ParallelError) and "out of step" in str(tp.failed)
        with pytest.raises(ParallelError):
            parts.target.model.embed(torch.tensor([1]))
    finally:
        stop_workers(tp)
        for p in tp.processes.values():
            if p.poll() is None:
                p.kill()


def test_a_rank_that_cannot_hold_its_kv_slice_is_refused_naming_it(one, monkeypatch):
    """A worker on a machine with less memory (another node) refuses its slice of the pool, and the
    driver fails start-up naming that rank (on one machine the driver's own check fires first, so
    both halves are driven here directly)."""
    import contextlib
    from types import SimpleNamespace

    import specserve.engine.config as engine_config
    from specserve.parallel import worker
    from specserve.parallel.group import share_plan

    plan = [8, 16, 0, 0, 0, 0, 0]  # blocks, block size, window blocks, KV dtype (fp32), no recurrent states
    monkeypatch.setattr(engine_config, "available_memory", lambda device: 1 << 40)
    assert worker.allocate_kv(one.model, plan) is not None
    monkeypatch.setattr(engine_config, "available_memory", lambda device: 4096)
    assert worker.allocate_kv(one.model, plan) is None

    class RefusingGroup:  # the collective's answer when rank 1 flagged its refusal (rank + 1)
        def lead(self, op, tensors):
            return contextlib.nullcontext()

        def max_flag(self, flag):
            return 2

    pool = SimpleNamespace(num_blocks=8, block_size=16, window_blocks=0, kv_dtype="fp32", state_slots=0,
                           state_planes=0, state_checkpoints=0)
    with pytest.raises(SpecserveError, match="rank 1: its slice of the KV pool"):
        share_plan(RefusingGroup(), pool)


def test_the_drivers_prefetch_hint_reaches_every_rank(one, tp2):
    """The prefetch hint is each process's own (its C library's) while the engine's trial times
    forwards every rank takes part in: the driver sends each setting that changes to the workers (a
    HINT call between forwards), a worker applies it, and the ranks stay in step through a trial
    that flips the hint forward by forward, with the same tokens (prefetch moves no bits)."""
    from specserve.kernels import library
    from specserve.kernels.tune import HintTrial
    from specserve.parallel import worker
    from specserve.parallel.group import Op, share_hint

    sent, local = [], []

    class Recorder:
        def send(self, op, tensors):
            sent.append((op, tensors[0].tolist()))

    set_t0 = share_hint(Recorder(), local.append)
    for on in (False, False, True, True, False):
        set_t0(on)
    assert sent == [(Op.HINT, [0]), (Op.HINT, [1]), (Op.HINT, [0])]
    assert local == [False, False, True, True, False]  # the driver's own, every time

    if not library.kernels_available():
        pytest.skip("no C compiler")
    calls = iter([(Op.HINT, [torch.tensor([1])]), (Op.STOP, [])])

    class Driver:  # a worker's view of the driver's calls
        rank = 1

        def receive(self, device):
            return next(calls)

    try:
        assert worker.serve(one.model, Driver()) == 0 and library.prefetch_t0() is True
        library.set_prefetch_t0(False)
        assert library.prefetch_t0() is False
        plain = engine(tp2)
        assert "share_hint" in plain.runner.hint.set_t0.__qualname__  # the engine's own trial reaches the workers
        before = run_all(plain, prompts(2), GREEDY)
        eng = engine(tp2)
        eng.runner.hint = HintTrial(share_hint(tp2.model.tp, library.set_prefetch_t0), pairs=4, skip=0)
        assert run_all(eng, prompts(2), GREEDY) == before
        assert eng.runner.hint.choice is not None and tp2.model.tp.failed is None
    finally:
        library.set_prefetch_t0(False)
