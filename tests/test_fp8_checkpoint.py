"""FP8 checkpoints (quantization_config quant_method "fp8", block-wise weight_scale_inv; and
compressed-tensors' FP8, weight_scale per tensor, channel, group or block): read dequantized, against
transformers' own loaders (FP8: its FineGrainedFP8, which dequantizes on a CPU; compressed-tensors:
the compressed-tensors package decompressing) on tiny random models; other quantization methods and
broken FP8 tensors are refused at load, naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from engine_utils import logits_of_every_position  # noqa: E402
from equivalence_utils import random_prompt  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny_models import FP32, make_tiny_hybrid, make_tiny_target, make_tiny_vl, write_fp8_copy  # noqa: E402

from specserve.engine.config import EngineConfig  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.errors import ModelLoadError  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.models.safetensors_dir import Fp8Weight  # noqa: E402
from specserve.speculative.mtp_checkpoint import read_checkpoint_mtp  # noqa: E402


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """kind -> (unquantized dir, FP8 dir, names quantized)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    make_tiny_target(root / "llama")
    make_tiny_hybrid(root / "qwen3_5")
    for kind, block in (("llama", (32, 32)), ("qwen3_5", (16, 32))):
        names = write_fp8_copy(root / kind, root / f"{kind}_fp8", block)
        out[kind] = (root / kind, root / f"{kind}_fp8", names)
    return out


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_fp8_checkpoint_matches_transformers(kind, fp8_dirs):
    """Our model from the FP8 directory computes what transformers' model from it computes (both
    dequantize), and not what the unquantized model computes (the weights really are FP8)."""
    _, fp8, names = fp8_dirs[kind]
    assert len(names) >= 10
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.float32).eval()
    _check_against(hf, fp8, fp8_dirs[kind][0], seed=3, steps=8)


def _check_against(hf, quantized, plain_dir, seed: int, steps: int) -> None:
    """Our model from ``quantized`` gives ``hf``'s logits over a prompt and ``steps - 1`` of our greedy
    tokens (within 1e-4), and the unquantized model's differ (the weights really are FP8)."""
    prompt = random_prompt(40, seed=seed)
    logits = _logits(load_model(str(quantized), FP32), prompt, steps)
    tokens = prompt + logits.argmax(-1)[len(prompt) - 1:].tolist()
    ref = hf(torch.tensor([tokens[:-1]])).logits[0]
    assert logits.shape == ref.shape and float(ref.abs().max()) > 1.0
    assert float((logits - ref).abs().max()) < 1e-4
    plain = _logits(load_model(str(plain_dir), FP32), prompt, 1)
    assert float((plain[:len(prompt)] - ref[:len(prompt)]).abs().max()) > 1e-2  # FP8 rounding shows


def _logits(model, prompt: list[int], steps: int) -> torch.Tensor:
    """Every prompt position's logits and ``steps - 1`` greedy decode steps', [len + steps - 1, V]."""
    eng = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, kv_cache_memory=1 << 22))
    eng.add_request("a", prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
    return logits_of_every_position(eng, "a")[0]


def test_fp8_mtp_head_is_dequantized(fp8_dirs):
    """The checkpoint's MTP head is read through the same path: its FP8 matrices come back within
    FP8's rounding of the originals (raw FP8 values would be hundreds of times too large)."""
    plain, fp8, names = fp8_dirs["qwen3_5"]
    assert any(n.startswith("mtp.") for n in names)
    want, _ = read_checkpoint_mtp(plain)
    got, _ = read_checkpoint_mtp(fp8)
    assert want.keys() == got.keys()
    for k in want:
        tol = 0.07 * float(want[k].abs().max())  # e4m3: 3 mantissa bits
        assert torch.allclose(got[k], want[k], atol=tol, rtol=0), k


def test_fp8_vision_tower_is_dequantized(tmp_path):
    """An image-text checkpoint whose vision tower is FP8 too: the tower's matrices come back within
    FP8's rounding of the originals."""
    from specserve.models.vision import _read_visual_tensors

    make_tiny_vl(tmp_path / "vl", mtp=False)
    names = write_fp8_copy(tmp_path / "vl", tmp_path / "vl_fp8", (16, 16))
    assert any(".visual." in n or n.startswith("visual.") for n in names)
    want, got = _read_visual_tensors(tmp_path / "vl"), _read_visual_tensors(tmp_path / "vl_fp8")
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == torch.float32 or got[k].dtype == want[k].dtype, k
        tol = 0.07 * float(want[k].abs().max())
        assert torch.allclose(got[k].float(), want[k].float(), atol=tol, rtol=0), k


def test_block_grid_with_short_edge_blocks():
    """A weight whose dims do not divide by the block: the grid is ceil(rows / bm) x ceil(cols / bn)
    and element (i, j) takes scale (i // bm, j // bn); one scale for the tensor; MXFP8's uint8
    exponents; stacked experts keep their leading dim."""
    w = torch.randn(5, 7).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3) + 0.5
    got = Fp8Weight(w, s, (2, 3), "w").dequantize()
    want = torch.tensor([[float(w[i, j].float()) * float(s[i // 2, j // 3]) for j in range(7)] for i in range(5)])
    assert torch.equal(got, want)
    assert torch.equal(Fp8Weight(w, torch.tensor(0.5), (2, 3), "w").dequantize(), w.float() * 0.5)
    assert torch.equal(Fp8Weight(w, torch.full((3, 3), 130, dtype=torch.uint8), (2, 3), "w").dequantize(), w.float() * 8)
    experts = torch.stack([w, w]).clone()
    both = Fp8Weight(experts, torch.stack([s, 2 * s]), (2, 3), "experts").dequantize()
    assert torch.equal(both[0], want) and torch.equal(both[1], 2 * want)
    with pytest.raises(ModelLoadError, match=r"tensor w: scale shape \(2, 3\) .* \(expected \(3, 3\)\)"):
        Fp8Weight(w, torch.ones(2, 3), (2, 3), "w").dequantize()


def test_scales_in_another_shard(fp8_dirs, tmp_path):
    """A sharded checkpoint whose weight and its weight_scale_inv sit in different files reads as the
    one-file checkpoint does."""
    import shutil

    src = fp8_dirs["llama"][1]
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    scales = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    save_file(scales, str(d / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({k: v for k, v in tensors.items() if k not in scales}, str(d / "model-00001-of-00002.safetensors"),
              metadata={"format": "pt"})
    a, b = load_model(str(src), FP32), load_model(str(d), FP32)
    prompt = random_prompt(20, seed=4)
    assert torch.equal(_logits(a, prompt, 1), _logits(b, prompt, 1))


def _edit(directory, config=None, drop=None):
    if config is not None:
        cfg = json.loads((directory / "config.json").read_text())
        cfg["quantization_config"] = config
        (directory / "config.json").write_text(json.dumps(cfg))
    if drop is not None:
        f = directory / "model.safetensors"
        tensors = load_file(str(f))
        del tensors[drop]
        save_file(tensors, str(f), metadata={"format": "pt"})


CT_STRATEGIES = {"tensor": "tensor", "channel": "channel", "group": ("group", 32), "block": (32, 16)}


@pytest.fixture(scope="module")
def ct_dirs(fp8_dirs, tmp_path_factory):
    """strategy -> a compressed-tensors FP8 copy of the tiny Llama (and "qwen3_5": of the hybrid,
    per channel, as RedHat's FP8-dynamic releases)."""
    root = tmp_path_factory.mktemp("ct")
    out = {}
    for name, block in CT_STRATEGIES.items():
        write_fp8_copy(fp8_dirs["llama"][0], root / name, block, layout="compressed-tensors")
        out[name] = root / name
    write_fp8_copy(fp8_dirs["qwen3_5"][0], root / "qwen3_5", "channel", layout="compressed-tensors")
    out["qwen3_5"] = root / "qwen3_5"
    return out


@torch.inference_mode()
@pytest.mark.parametrize("strategy", [*CT_STRATEGIES, "qwen3_5"])
def test_compressed_tensors_fp8_matches_transformers(strategy, ct_dirs, fp8_dirs):
    """Our model from a compressed-tensors FP8 directory computes what transformers' model computes
    from it, decompressed by the compressed-tensors package (its activation scales skipped by both),
    and not what the unquantized model computes."""
    d = ct_dirs[strategy]  # (transformers decompresses with the compressed-tensors package, a test dependency)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
    _check_against(hf, d, fp8_dirs["qwen3_5" if strategy == "qwen3_5" else "llama"][0], seed=4, steps=6)


@pytest.mark.parametrize("case", ["int4", "asymmetric", "strategy", "no_scale"])
def test_compressed_tensors_we_cannot_read_fails_at_load(case, ct_dirs, tmp_path):
    """int4 weights (pack-quantized), an asymmetric or unknown FP8 scheme and a missing weight_scale
    fail at load, naming what is wrong."""
    import shutil

    from tiny_models import compressed_tensors_config

    d = tmp_path / case
    shutil.copytree(ct_dirs["channel"], d)
    cfg = compressed_tensors_config("channel")
    weights = cfg["config_groups"]["group_0"]["weights"]
    name = "model.layers.0.self_attn.q_proj.weight"
    if case == "int4":
        cfg["format"], weights["type"], weights["num_bits"] = "pack-quantized", "int", 4
        match = "compressed-tensors format 'pack-quantized' is not supported"
    elif case == "asymmetric":
        weights["symmetric"] = False
        match = "asymmetric FP8 weights"
    elif case == "strategy":
        weights["strategy"] = "tensor_group"
        match = "FP8 weight strategy 'tensor_group' is not supported"
    else:
        _edit(d, drop=name + "_scale")
        match = f"tensor {name} is torch.float8_e4m3fn but the checkpoint has no {name}_scale"
    if case != "no_scale":
        _edit(d, config=cfg)
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d), FP32)


@pytest.mark.parametrize("case", ["awq", "no_scale", "bad_block"])
def test_what_cannot_be_read_fails_at_load(case, fp8_dirs, tmp_path):
    """A quantization method we do not read, an FP8 weight without its scale and a malformed block
    size each fail at load with an error naming it (before, an FP8 weight was read as its raw values)."""
    import shutil

    d = tmp_path / case
    shutil.copytree(fp8_dirs["llama"][1], d)
    name = "model.layers.0.self_attn.q_proj.weight"
    if case == "awq":
        _edit(d, config={"quant_method": "awq", "bits": 4})
        match = "quant_method 'awq' is not supported"
    elif case == "no_scale":
        _edit(d, drop=name + "_scale_inv")
        match = f"tensor {name} is torch.float8_e4m3fn but the checkpoint has no {name}_scale_inv"
    else:
        _edit(d, config={"quant_method": "fp8", "weight_block_size": [128]})
        match = "weight_block_size must be two positive integers"
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d), FP32)
