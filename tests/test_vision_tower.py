"""The Qwen3.5 vision tower and its image preprocessing against transformers (the oracle: the tiny
random Qwen3_5ForConditionalGeneration of tests/tiny_models.py), and the same tower read from
llama.cpp's mmproj GGUF (committed; made by tests/data/make_tiny_qwen35_vl.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from specserve.errors import ModelLoadError
from specserve.models.image_processor import ImageProcessor
from specserve.models.vision import (VisionConfig, VisionTower, expected_shapes, load_mmproj, load_vision_tower,
                                     vision_config_from_hf)
from tiny_models import VL_IDS, make_tiny_vl

DATA = Path(__file__).resolve().parent / "data" / "tiny_qwen35_vl"
MMPROJ_F32 = DATA / "mmproj-tiny-qwen35-vl-f32.gguf"
MMPROJ_Q8 = DATA / "mmproj-tiny-qwen35-vl-q8_0.gguf"
needs_mmproj = pytest.mark.skipif(not MMPROJ_F32.exists(), reason="run tests/data/make_tiny_qwen35_vl.py")


def drawn(size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A picture of rectangles and ellipses in a few colours (alpha varies in RGBA)."""
    g = torch.Generator().manual_seed(seed)
    w, h = size
    img = Image.new("RGBA", size, (30, 60, 200, 255))
    d = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = (torch.randint(0, max(w - 1, 1), (1,), generator=g).item() for _ in range(2))
        x1, y1 = x0 + torch.randint(1, w, (1,), generator=g).item(), y0 + torch.randint(1, h, (1,), generator=g).item()
        fill = tuple(torch.randint(0, 256, (4,), generator=g).tolist())
        (d.ellipse if torch.rand(1, generator=g).item() < 0.5 else d.rectangle)((x0, y0, x1, y1), fill=fill)
    return img if mode == "RGBA" else img.convert(mode)


IMAGES = {"50x37": ((50, 37), "RGB"), "64x64": ((64, 64), "RGB"), "17x120": ((17, 120), "RGB"),
          "200x90": ((200, 90), "RGB"), "33x33": ((33, 33), "RGB"), "rgba-41x58": ((41, 58), "RGBA"),
          "gray-45x30": ((45, 30), "L"), "palette-70x20": ((70, 20), "P")}


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_vl")
    return directory, make_tiny_vl(directory, seed=0)


@pytest.fixture(scope="module")
def tower(tiny_vl):
    return load_vision_tower(tiny_vl[0])


@pytest.fixture(scope="module")
def processors(tiny_vl):
    import transformers

    return ImageProcessor(tiny_vl[0]), transformers.AutoImageProcessor.from_pretrained(str(tiny_vl[0]), backend="pil")


def oracle(hf, pixels: torch.Tensor, grid) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.visual(pixels, grid_thw=torch.tensor([list(grid)])).pooler_output


@pytest.mark.parametrize("name", IMAGES)
def test_matches_transformers(name, tiny_vl, tower, processors):
    ours, theirs = processors
    size, mode = IMAGES[name]
    image = drawn(size, mode, seed=len(name))
    pixels, grid = ours(image)
    ref = theirs(image, return_tensors="pt")  # transformers' own RGB conversion of the raw image
    assert grid == tuple(ref["image_grid_thw"][0].tolist())
    assert pixels.dtype == torch.float32 and torch.equal(pixels, ref["pixel_values"])
    out = tower(pixels, grid)
    assert out.shape == (ours.num_tokens(grid), 64) == (tower.config.tokens_per_image(grid), 64)
    torch.testing.assert_close(out, oracle(tiny_vl[1], pixels, grid), rtol=1e-5, atol=1e-5)


def test_frames_attend_separately(tiny_vl, tower, processors):
    """A two-frame grid: attention within each frame (transformers' cu_seqlens), positions repeated."""
    a, grid = processors[0](drawn((64, 40), seed=1))
    b, _ = processors[0](drawn((64, 40), seed=2))
    pixels, clip = torch.cat([a, b]), (2, *grid[1:])
    torch.testing.assert_close(tower(pixels, clip), oracle(tiny_vl[1], pixels, clip), rtol=1e-5, atol=1e-5)


def test_deterministic(tower, processors):
    pixels, grid = processors[0](drawn((200, 90), seed=3))
    assert torch.equal(tower(pixels, grid), tower(pixels, grid))


def test_config(tiny_vl):
    cfg = vision_config_from_hf(json.loads((tiny_vl[0] / "config.json").read_text()))
    assert cfg == VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=8,
                               temporal_patch_size=2, in_channels=3, spatial_merge_size=2, out_hidden_size=64,
                               num_position_embeddings=36, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0,
                               image_token_id=VL_IDS["image_token_id"],
                               vision_start_token_id=VL_IDS["vision_start_token_id"],
                               vision_end_token_id=VL_IDS["vision_end_token_id"])
    assert cfg.tokens_per_image((1, 4, 6)) == 6
    assert vision_config_from_hf({"hidden_size": 8}) is None


def test_no_vision_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    assert load_vision_tower(tmp_path) is None


def _visual_copy(src: Path, dst: Path, edit) -> Path:
    """dst: src's config and its visual tensors (``visual.*`` names), edited."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = {k.removeprefix("model."): v for k, v in load_file(src / "model.safetensors").items()
               if k.startswith("model.visual.")}
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_visual_prefix_accepted(tiny_vl, tower, tmp_path):
    other = load_vision_tower(_visual_copy(tiny_vl[0], tmp_path / "ok", lambda t: None))
    pixels = torch.randn(16, tower.config.patch_dim)
    assert torch.equal(other(pixels, (1, 4, 4)), tower(pixels, (1, 4, 4)))


def test_missing_tensor_named(tiny_vl, tmp_path):
    directory = _visual_copy(tiny_vl[0], tmp_path / "missing", lambda t: t.pop("visual.blocks.1.attn.qkv.bias"))
    with pytest.raises(ModelLoadError, match=r"blocks\.1\.attn\.qkv\.bias"):
        load_vision_tower(directory)


def test_bad_shape_named(tiny_vl, tmp_path):
    def edit(t):
        t["visual.merger.linear_fc2.weight"] = t["visual.merger.linear_fc2.weight"][:, :-1].contiguous()

    with pytest.raises(ModelLoadError, match=r"merger\.linear_fc2\.weight has shape \(64, 127\)"):
        load_vision_tower(_visual_copy(tiny_vl[0], tmp_path / "shape", edit))


def test_bad_grid(tower):
    with pytest.raises(ValueError):
        tower(torch.zeros(12, tower.config.patch_dim), (1, 3, 4))  # 3 rows: not whole 2 x 2 blocks


def test_max_pixels_override(tiny_vl, processors):
    capped = ImageProcessor(tiny_vl[0], max_pixels=1024)
    image = drawn((200, 90), seed=4)
    pixels, grid = capped(image)
    ref = processors[1](image, size={"shortest_edge": 256, "longest_edge": 1024}, return_tensors="pt")
    assert torch.equal(pixels, ref["pixel_values"]) and grid == tuple(ref["image_grid_thw"][0].tolist())
    assert grid[1] * grid[2] * 64 <= 1024 < processors[0](image)[0].shape[0] * 64


def test_explicit_parameters_equal_config(tiny_vl, processors):
    explicit = ImageProcessor(patch_size=8, temporal_patch_size=2, merge_size=2, image_mean=(0.5,) * 3,
                              image_std=(0.5,) * 3, min_pixels=256, max_pixels=4096)
    for name in ("50x37", "rgba-41x58"):
        image = drawn(*IMAGES[name])
        a, b = explicit(image), processors[0](image)
        assert torch.equal(a[0], b[0]) and a[1] == b[1]
    with pytest.raises(ModelLoadError):
        ImageProcessor(patch_size=8)


def test_activation_bytes_is_an_upper_bound():
    """Peak CPU memory of one forward (the profiler's allocations and frees in order) stays under
    activation_bytes, for a tower wider than the tiny one."""
    from torch.profiler import ProfilerActivity, profile

    cfg = VisionConfig(depth=1, hidden_size=64, num_heads=4, intermediate_size=160, patch_size=8,
                       temporal_patch_size=2, in_channels=3, spatial_merge_size=2, out_hidden_size=64,
                       num_position_embeddings=36)
    g = torch.Generator().manual_seed(0)
    tower = VisionTower(cfg, {k: torch.randn(s, generator=g) * 0.05 for k, s in expected_shapes(cfg).items()})
    pixels = torch.randn(24 * 32, cfg.patch_dim)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tower(pixels, (1, 24, 32))
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    assert tower.nbytes == sum(4 * torch.Size(s).numel() for s in expected_shapes(cfg).values())
    assert 0 < peak <= tower.activation_bytes(pixels.shape[0])


@needs_mmproj
def test_mmproj_matches_checkpoint():
    hf_tower = load_vision_tower(DATA / "hf")
    mm = load_mmproj(MMPROJ_F32, image_token_id=VL_IDS["image_token_id"])
    assert mm.config == VisionConfig(**{**hf_tower.config.__dict__, "vision_start_token_id": None,
                                        "vision_end_token_id": None})
    assert mm.nbytes == hf_tower.nbytes
    proc = ImageProcessor(DATA / "hf")
    q8 = load_mmproj(MMPROJ_Q8)
    for name in ("64x64", "17x120", "rgba-41x58"):
        pixels, grid = proc(drawn(*IMAGES[name]))
        ref = hf_tower(pixels, grid)
        torch.testing.assert_close(mm(pixels, grid), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q8(pixels, grid), ref, rtol=0, atol=0.05 * ref.abs().max().item())


@needs_mmproj
def test_mmproj_image_processor():
    """The mmproj's patch size, merge size, mean and std, with llama.cpp's Qwen-VL area limits."""
    proc = ImageProcessor.from_mmproj(MMPROJ_F32)
    assert (proc.min_pixels, proc.max_pixels) == (8 * 16 ** 2, 4096 * 16 ** 2)
    explicit = ImageProcessor(patch_size=8, merge_size=2, min_pixels=8 * 256, max_pixels=4096 * 256)
    image = drawn((200, 90))
    (a, grid), (b, grid_b) = proc(image), explicit(image)
    assert torch.equal(a, b) and grid == grid_b
    assert ImageProcessor.from_mmproj(MMPROJ_F32, max_pixels=1024).max_pixels == 1024


def test_mmproj_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError):
        load_mmproj(tmp_path / "x.gguf")
