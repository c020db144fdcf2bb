"""Qwen3.5-MoE (Qwen3.5's DeltaNet and gated attention, a mixture-of-experts MLP in every layer)
against transformers' Qwen3_5MoeForCausalLM on a tiny random checkpoint, and lossless under
speculation (an oracle drafter and the checkpoint's own MoE MTP head) with chunked prefill; its GGUF
(llama.cpp's converter) gives native llama-server's greedy tokens. Its MTP head against
transformers' modules is in test_hybrid_mtp.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("transformers.models.qwen3_5_moe")

from hybrid_utils import (DATA, LLAMA_CPP, check_lossless_with_oracle_and_mtp, check_matches_transformers,  # noqa: E402
                          greedy_outputs, llama_cpp_partings, make_engine)
from tiny_models import FP32  # noqa: E402

from specserve.models.loader import load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.mtp import MTPDrafter  # noqa: E402


def test_config_and_logits_match_transformers(qwen3_5_moe):
    """Every layer sparse (no dense width in the config), Qwen3.5's projections read as they are;
    prompt logits and greedy tokens as transformers'."""
    ours, hf = qwen3_5_moe
    cfg = ours.config
    assert cfg.arch == "qwen35moe" and cfg.moe.num_experts == 4 and cfg.moe.num_experts_per_tok == 2
    assert all(cfg.moe.sparse(i) for i in range(cfg.num_layers)) and cfg.moe.shared_intermediate_size == 48
    assert cfg.moe.norm_topk_prob and cfg.mtp_layers == 1
    check_matches_transformers(ours, hf, seed=5)


def test_speculation_and_chunking_are_lossless(qwen3_5_moe):
    check_lossless_with_oracle_and_mtp(qwen3_5_moe[0], seed=70)  # its MTP head: a MoE layer


def test_gguf_greedy_equals_llama_cpp():
    """llama.cpp's GGUF of a Qwen3.5-MoE (value heads tiled, experts merged into 3-D tensors, the MTP
    head in blk.4.nextn.*): native llama-server's greedy tokens, up to a near tie of two logits where
    one prompt's paths part (transformers' generate there picks what we pick); the same tokens as the
    safetensors it was converted from; and lossless with its MTP head drafting."""
    name = "tiny-qwen35moe-f32.gguf"
    ours = load_model(str(DATA / name), FP32)
    cfg = ours.config
    assert cfg.arch == "qwen35moe" and cfg.moe.num_experts == 4 and cfg.deltanet.v_tiled and cfg.mtp_layers == 1
    prompts, n = LLAMA_CPP["prompts"], LLAMA_CPP["tokens"]
    plain = [greedy_outputs(make_engine(ours), [p], n)[0] for p in prompts]
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(DATA / "moe_hf"), dtype=torch.float32).eval()
    same, partings = llama_cpp_partings(ours, name, plain)
    for _, before, mine, theirs, margin, _ in partings:  # only where two logits nearly tie
        assert margin < 1e-2, (len(before), mine, theirs, margin)
        with torch.no_grad():  # and transformers picks as we do there
            assert int(oracle(torch.tensor([before])).logits[0, -1].argmax()) == mine
    assert same >= 3 * n + n // 2, same  # seen: 32 + 25 + 32 + 32 (a tie of 0.0009 at the 26th token)
    hf = load_model(str(DATA / "moe_hf"), FP32)
    assert [greedy_outputs(make_engine(hf), [p], n)[0] for p in prompts] == plain
    mtp = make_engine(ours, SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False),
                      MTPDrafter.load(None, ours), max_num_seqs=4)
    assert greedy_outputs(mtp, prompts, n) == plain and mtp.totals.draft_tokens > 0


def test_llama_quantize_q8_0_loads_keeps_the_router_float_and_stays_lossless():
    """llama-quantize's Q8_0 of it: the shared expert's gate, written as a vector [H], loads as the
    one-row matrix it is (it failed to load before); the router and that gate stay float32 (llama.cpp
    keeps them F32: int8 there moves which experts a token gets), the experts keep the file's Q8_0
    blocks. Against llama-server on the same file the paths part only where two of our logits are
    close (both quantize activations to 8 bits, not identically: llama.cpp's block scales are fp16);
    speculation with the MTP head is lossless on it."""
    from specserve.models.layers import linears

    name = "tiny-qwen35moe-q8_0.gguf"
    ours = load_model(str(DATA / name))  # default CPU weights: the file's blocks
    mlp = ours.model.layers[0].mlp
    assert mlp.router.format == mlp.shared_gate.format == "fp32" and mlp.shared_gate.weight.shape == (1, 64)
    assert {lin.format for lin in linears(mlp.experts[0])} == {"Q8_0"}
    prompts, n = LLAMA_CPP["prompts"], LLAMA_CPP["tokens"]
    plain = greedy_outputs(make_engine(ours, max_num_seqs=4), prompts, n)
    same, partings = llama_cpp_partings(ours, name, plain)
    for _, before, mine, theirs, margin, top in partings:
        assert margin < 0.05 * top, (len(before), mine, theirs, margin)
    assert same >= 50, same  # seen: 3 + 10 + 32 + 14 of 123 (int8 routers: 11 + 4 + 32 + 1)
    mtp = make_engine(ours, SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False),
                      MTPDrafter.load(None, ours), max_num_seqs=4)
    assert greedy_outputs(mtp, prompts, n) == plain and mtp.totals.draft_tokens > 0
