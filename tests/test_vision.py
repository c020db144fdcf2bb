"""Images through the engine (tests/tiny_models.make_tiny_vl: a tiny random Qwen3.5 image-text
model): logits and greedy tokens against transformers' Qwen3_5ForConditionalGeneration (and its
MoE form, Qwen3_5MoeForConditionalGeneration), image
spans cut by chunked prefill, image keys in the prefix cache, and every drafter lossless and
deterministic on image prompts, alone and in a mixed batch of 8."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.multimodal import ImageInput, MultiModalPrompt, image_key
from specserve.engine.types import SamplingParams
from specserve.errors import ModelLoadError, RequestError
from specserve.models.loader import load_model
from engine_utils import drafter_makers, logits_of_every_position
from hybrid_utils import assert_same_bits
from tiny_models import FP32, VL_IDS, make_tiny_target, make_tiny_vl

RTOL = 1e-4
PAD, START, END = VL_IDS["image_token_id"], VL_IDS["vision_start_token_id"], VL_IDS["vision_end_token_id"]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(directory, our model, transformers' model) over the same tiny checkpoint."""
    d = tmp_path_factory.mktemp("tiny_vl")
    hf = make_tiny_vl(d)
    return d, load_model(str(d), FP32), hf


@pytest.fixture(scope="module")
def vl_moe(tmp_path_factory):
    """The same with Qwen3.5-MoE's text model (Qwen3_5MoeForConditionalGeneration)."""
    d = tmp_path_factory.mktemp("tiny_vl_moe")
    hf = make_tiny_vl(d, moe=True)
    return d, load_model(str(d), FP32), hf


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_vl_draft"), seed=1, layers=1)


def picture(seed: int, size: tuple[int, int] | None = None) -> Image.Image:
    """A generated test image: a background and a few shapes in random colours."""
    rnd = random.Random(seed)
    size = size or (rnd.randrange(16, 90), rnd.randrange(16, 90))
    img = Image.new("RGB", size, tuple(rnd.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = rnd.randrange(size[0]), rnd.randrange(size[1])
        box = (x0, y0, x0 + rnd.randrange(4, 40), y0 + rnd.randrange(4, 40))
        colour = tuple(rnd.randrange(256) for _ in range(3))
        (draw.ellipse if rnd.random() < 0.5 else draw.rectangle)(box, fill=colour)
    return img


def image_input(model, img: Image.Image) -> ImageInput:
    pixels, grid = model.image_processor(img)
    return ImageInput(image_key(pixels, grid), pixels, tuple(grid), model.vision.config.spatial_merge_size)


def build(model, parts: list) -> tuple[list[int], list[ImageInput]]:
    """parts: text (str) and images -> (token ids with each image's placeholder run, images)."""
    ids, images = [], []
    for p in parts:
        if isinstance(p, str):
            ids += model.tokenizer.encode(p)
        else:
            img = image_input(model, p)
            ids += [START] + [PAD] * img.num_tokens + [END]
            images.append(img)
    return ids, images


def image_prompts(model) -> list[tuple[list[int], list[ImageInput]]]:
    """20 prompts: one image, two images, and image / text / image over 5 turns."""
    out = []
    for s in range(8):
        out.append(build(model, [f"user {s}: what is this? ", picture(s), " say it twice: a b a b"]))
    for s in range(6):
        out.append(build(model, ["compare ", picture(100 + s), " with ", picture(200 + s), " now."]))
    for s in range(6):
        parts = []
        for turn in range(5):
            parts += [f"turn {turn}: look ", picture(300 + 10 * s + turn, (20 + 9 * turn, 30)) if turn % 2 == 0
                      else "and think about the last one. "]
        out.append(build(model, parts))
    return out


def engine(model, spec=None, drafter=None, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 512)
    return LLMEngine(model, EngineConfig(**kw), spec, drafter)


def greedy(eng: LLMEngine, prompts, n: int = 24) -> list[list[int]]:
    for i, (ids, images) in enumerate(prompts):
        eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=n, ignore_eos=True), images)
    got = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    return [got[f"r{i}"] for i in range(len(prompts))]


def hf_inputs(hf, ids: list[int], images: list[ImageInput]) -> dict:
    x = torch.tensor([ids])
    kw = dict(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == PAD).int())
    if images:
        kw["pixel_values"] = torch.cat([img.pixels for img in images])
        kw["image_grid_thw"] = torch.tensor([img.grid for img in images])
    return kw


# ---- positions -------------------------------------------------------------------------------
def test_positions_follow_transformers_rope_index(vl):
    _, ours, hf = vl
    ids, images = build(ours, ["ab ", picture(1, (50, 37)), " cd ", picture(2, (17, 60)), " e"])
    mm = MultiModalPrompt.build(ids, images, PAD)
    ref, delta = hf.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == PAD).int(),
                                         image_grid_thw=torch.tensor([img.grid for img in images]))
    assert torch.equal(mm.positions.long(), ref[:, 0].T.long())
    assert mm.delta == int(delta)
    tail = mm.rope_rows(len(ids) - 2, 5)  # two prompt tokens, three past the prompt
    assert tail[2:].tolist() == [[len(ids) + j + mm.delta] * 3 for j in range(3)]
    with pytest.raises(ValueError):
        MultiModalPrompt.build(ids, images[:1], PAD)


# ---- against transformers --------------------------------------------------------------------
@pytest.mark.parametrize("which", ["vl", "vl_moe"])
def test_logits_match_transformers_with_two_images(which, request):
    _, ours, hf = request.getfixturevalue(which)
    ids, images = build(ours, ["look: ", picture(3, (64, 40)), " and ", picture(4, (24, 72)), " so"])
    eng = engine(ours)
    eng.add_request("a", ids, SamplingParams(max_tokens=17, ignore_eos=True), images)
    got, seq = logits_of_every_position(eng, "a")
    tokens = ids + seq.output_ids
    with torch.no_grad():
        ref = hf(**hf_inputs(hf, tokens[:-1], images)).logits[0]
    assert got.shape == ref.shape
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= RTOL * scale, float((got - ref).abs().max() / scale)


@pytest.mark.parametrize("which", ["vl", "vl_moe"])
def test_greedy_equals_transformers_generate_with_images(which, request):
    _, ours, hf = request.getfixturevalue(which)
    for s in range(3):
        ids, images = build(ours, [f"q{s} ", picture(10 + s), " ok"] + ([picture(20 + s), "!"] if s else []))
        with torch.no_grad():
            ref = hf.generate(**hf_inputs(hf, ids, images), max_new_tokens=24, do_sample=False)[0, len(ids):]
        ref = ref.tolist()
        assert len(ref) >= 8 and greedy(engine(ours), [(ids, images)])[0][:len(ref)] == ref


# ---- the engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["vl", "vl_moe"])
def test_fused_layers_take_image_rows_with_the_python_path_bits(monkeypatch, which, request):
    """Forwards with image rows run the layers in one C call with their per-row M-RoPE table, and give
    the Python path's bits: prompts with images prefilled in chunks beside decoding rows."""
    ours = request.getfixturevalue(which)[1]
    prompts = image_prompts(ours)[:3]
    got = assert_same_bits(monkeypatch, ours, lambda: greedy(engine(ours, max_num_seqs=3, max_num_batched_tokens=48,
                                                                       max_step_ms=0), prompts, 8))
    assert len(got) == 3


def test_chunk_boundaries_inside_images_change_nothing(vl):
    _, ours, _ = vl
    prompts = image_prompts(ours)[:3] + image_prompts(ours)[14:15]
    whole = greedy(engine(ours, max_step_ms=0), prompts)
    for chunk in (5, 13):  # chunks start and end inside every image span
        eng = engine(ours, max_num_batched_tokens=chunk, max_step_ms=0)
        assert greedy(eng, prompts) == whole
        assert eng.runner.encoder.misses == len({img.key for _, imgs in prompts for img in imgs})


def test_prefix_cache_keys_images_by_content(vl):
    _, ours, _ = vl
    head = "a shared system prompt long enough for two blocks of sixteen tokens: "
    a = build(ours, [head, picture(40, (64, 64)), " describe it in detail please"])
    b = build(ours, [head, picture(41, (64, 64)), " describe it in detail please"])
    assert a[0] == b[0] and a[1][0].key != b[1][0].key  # the same token ids, another image
    eng = engine(ours)
    first = greedy(eng, [a])[0]
    eng.add_request("again", *a[:1], SamplingParams(max_tokens=24, ignore_eos=True), a[1])
    eng.scheduler.admit()
    placed = eng.by_id["again"].mm.images[0]
    assert eng.by_id["again"].num_cached >= placed.end - 16  # the image is a hit
    while eng.has_work():
        eng.step()
    eng.add_request("other", *b[:1], SamplingParams(max_tokens=24, ignore_eos=True), b[1])
    eng.scheduler.admit()
    assert eng.by_id["other"].num_cached <= placed.offset  # at most the text before the image
    while eng.has_work():
        eng.step()
    assert greedy(engine(ours, enable_prefix_caching=False), [b]) == greedy(eng, [b])
    assert greedy(eng, [a]) == [first]


def test_a_text_model_refuses_images(vl, draft):
    _, ours, _ = vl
    ids, images = build(ours, ["x ", picture(5), " y"])
    with pytest.raises(RequestError, match="does not read images"):
        engine(draft).add_request("a", ids, SamplingParams(max_tokens=4), images)
    with pytest.raises(RequestError, match="placeholder"):
        cut = ids.index(PAD)
        engine(ours).add_request("b", ids[:cut] + ids[cut + 1:], SamplingParams(max_tokens=4), images)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "mtp", "dflash"])
def test_every_drafter_is_lossless_and_deterministic_on_images(vl, draft, method):
    d, ours, _ = vl
    prompts = image_prompts(ours)
    plain = greedy(engine(ours), prompts)
    make = drafter_makers(d, ours, draft, 512)[method]
    eng = engine(ours, *make())
    assert greedy(eng, prompts) == plain
    assert eng.totals.draft_tokens > 0 and eng.cache.idle()
    assert greedy(engine(ours, *make()), prompts) == plain  # a second run: the same bytes
    texts = [(ours.tokenizer.encode(f"plain text {s}: a b a b a b"), []) for s in range(4)]
    mixed = [p for pair in zip(prompts[::5], texts) for p in pair]  # 8: image and text requests
    alone = greedy(engine(ours), mixed)
    assert greedy(engine(ours, *make(), max_num_seqs=8), mixed) == alone


# ---- a GGUF model with a llama.cpp mmproj ----------------------------------------------------
DATA = Path(__file__).resolve().parent / "data" / "tiny_qwen35_vl"  # tests/data/make_tiny_qwen35_vl.py


def test_gguf_with_mmproj_reads_images_as_the_checkpoint_does():
    """llama.cpp's converter made the text GGUF and the mmproj of the committed checkpoint: with
    --mmproj the GGUF model gives the checkpoint's greedy tokens on image prompts."""
    ref = load_model(str(DATA / "hf"), FP32)
    mmproj = str(DATA / "mmproj-tiny-qwen35-vl-f32.gguf")
    gguf = load_model(str(DATA / "tiny-qwen35-vl-f32.gguf"), replace(FP32, mmproj=mmproj))
    assert gguf.config.mrope_section == ref.config.mrope_section
    assert gguf.vision.config.image_token_id == PAD
    prompts = image_prompts(ref)[:2] + image_prompts(ref)[8:9]
    want = greedy(engine(ref), prompts)
    assert greedy(engine(gguf), prompts) == want
    with pytest.raises(ModelLoadError, match="--mmproj"):
        load_model(str(DATA / "hf"), replace(FP32, mmproj=mmproj))
    assert load_model(str(DATA / "tiny-qwen35-vl-f32.gguf"), FP32).vision is None


def test_drafter_rope_tables_give_the_target_m_rope(vl):
    """The MTP / drafter layers' M-RoPE tables equal the target's per-row tables (and a text row,
    t = h = w, equals the 1-D table)."""
    from specserve.models.layers import Rope
    from specserve.speculative.layers import rope_tables

    _, ours, _ = vl
    ids, images = build(ours, ["ab ", picture(1, (50, 37)), " cd"])
    pos3 = MultiModalPrompt.build(ids, images, PAD).positions
    section = ours.config.mrope_section
    rope = Rope(ours.config.rotary_dim, ours.config.rope_theta, 512, torch.device("cpu")).rows(pos3, section)
    cos, sin = rope_tables(ours.config.rotary_dim, ours.config.rope_theta, pos3, section)
    torch.testing.assert_close(cos, rope.cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, rope.sin, rtol=1e-6, atol=1e-6)
    text = torch.arange(5).unsqueeze(1).expand(5, 3)
    assert torch.equal(rope_tables(8, 1e4, text, section)[0], rope_tables(8, 1e4, torch.arange(5))[0])


def test_memory_plan_counts_the_vision_tower_up_front(vl):
    from specserve.commands.plan import format_plan
    from specserve.engine.llm_engine import plan_for

    _, ours, _ = vl
    ecfg = EngineConfig(max_model_len=512, encoder_cache_bytes=8 << 20)
    plan = plan_for(ours, ecfg, None, None)
    tower = ours.vision
    biggest = ours.image_processor.max_pixels // tower.config.patch_size ** 2
    assert plan.vision_weight_bytes == tower.nbytes > 0
    assert plan.vision_activation_bytes == tower.activation_bytes(biggest) > 0
    assert plan.encoder_cache_bytes == 8 << 20
    text_only = plan_for(load_model(str(DATA / "tiny-qwen35-vl-f32.gguf"), FP32), ecfg, None, None)
    assert text_only.vision_bytes == 0
    assert plan.total_bytes == plan.weight_bytes + plan.pool_bytes + plan.state_bytes + plan.vision_bytes
    assert "vision tower" in format_plan(plan) and "vision" not in format_plan(text_only)


def test_images_are_encoded_ahead_a_block_per_step_while_streams_decode(vl):
    """While a stream decodes, an image prompt's images go through the tower a slice per step (a
    tiny --max-step-ms: one block each), its chunks stop before an image not encoded yet, and
    every output is still plain greedy's; with no stream decoding an image is encoded whole."""
    _, ours, _ = vl
    prompts = image_prompts(ours)[8:10]  # two images each
    stream = (ours.tokenizer.encode("a stream that decodes all along: a b a b"), [])
    want = [greedy(engine(ours), [p], 24)[0] for p in [stream] + prompts]
    eng = engine(ours, max_step_ms=1e-6)
    eng.add_request("s", stream[0], SamplingParams(max_tokens=24, ignore_eos=True))
    got = {"s": [], "r0": [], "r1": []}
    while not got["s"]:  # the stream decodes
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    for i, (ids, images) in enumerate(prompts):
        eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=24, ignore_eos=True), images)
    while eng.has_work():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert [got["s"], got["r0"], got["r1"]] == want
    enc = eng.runner.encoder
    assert enc.most_blocks_per_call == 1 and enc.misses == 4 and not enc.pending
    whole = engine(ours)
    greedy(whole, prompts[:1])
    assert whole.runner.encoder.most_blocks_per_call == 2 * ours.vision.config.depth  # both images at once


def test_encoder_cache_drops_the_least_recently_used_image_past_its_bytes(vl):
    from specserve.engine.multimodal import EncoderCache

    _, ours, _ = vl
    imgs = [image_input(ours, picture(60 + i, (64, 64))) for i in range(3)]
    one = imgs[0].num_tokens * ours.config.hidden_size * 4  # bytes of one image's embeddings
    cache = EncoderCache(ours.vision, max_bytes=2 * one)
    first = cache.get(imgs[0]).clone()
    cache.get(imgs[1])
    cache.get(imgs[0])  # used again: imgs[1] is now the least recent
    cache.get(imgs[2])
    assert cache.ready(imgs[0].key) and not cache.ready(imgs[1].key) and cache.ready(imgs[2].key)
    assert cache.bytes == 2 * one and cache.misses == 3 and cache.hits == 1
    assert torch.equal(cache.get(imgs[0]), first)


def test_decode_steps_after_an_image_keep_the_1d_rotary_table(vl):
    """A batch with image tokens gets (t, h, w) positions; one of text rows only (decode after an
    image: index + delta on every axis) gets 1-D positions, so it runs the plain rope."""
    _, ours, _ = vl
    ids, images = build(ours, ["x ", picture(70, (64, 64)), " y"])
    eng = engine(ours)
    eng.add_request("a", ids, SamplingParams(max_tokens=4, ignore_eos=True), images)
    eng.scheduler.admit()
    eng.encode_ahead()
    rows = eng.scheduler.schedule(drafting=False)
    assert eng.runner.batch(rows).rope_positions.shape == (len(ids), 3)
    eng._process(rows, eng.runner.run(rows).logits, {})
    seq = eng.by_id["a"]
    rows = eng.scheduler.schedule(drafting=False)
    pos = eng.runner.batch(rows).rope_positions
    assert pos.shape == (1,) and int(pos[0]) == seq.num_computed + seq.mm.delta < seq.num_computed


@pytest.mark.parametrize("method", [None, "ngram", "suffix", "draft_model", "mtp", "dflash"])
def test_a_dropped_engine_is_freed_without_a_gc_pass(vl, draft, method):
    """No reference cycle through the engine (a bound method handed to the scheduler was one): a
    process that builds engines one after another (tests, benchmarks, a reload) frees each one's
    KV pool and drafter when its last reference goes, not at some later full gc pass."""
    import gc
    import weakref

    d, ours, _ = vl
    spec, drafter = drafter_makers(d, ours, draft, 512)[method]() if method else (None, None)
    eng = engine(ours, spec, drafter)
    greedy(eng, image_prompts(ours)[:3], n=6)
    refs = [weakref.ref(eng), weakref.ref(eng.kv), weakref.ref(eng.scheduler)]
    gc.disable()
    try:
        del eng, drafter
        assert [r() is None for r in refs] == [True] * 3
    finally:
        gc.enable()
