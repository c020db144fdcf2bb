"""Our model code (specserve.models) against an independent implementation: transformers.

* real GGUF models (smollm2-135m, gemma3-270m): transformers loads the same GGUF file;
  logits over a >= 64 token prompt plus 32 decode steps through our paged KV cache agree to
  1e-3 (fp32), greedy continuations agree for 32 tokens (transformers' own ``generate``), the
  configs and the tokenizers agree, and gemma3's logits past its 512-token window agree;
* tiny randomly initialised Llama (tied / untied), Mistral (sliding), Qwen2 (plain / sliding
  layers), Qwen3 and Gemma 3 (sliding window 16, with / without final softcapping and linear
  rope scaling) checkpoints written with ``save_pretrained``, read by our loader: same criteria;
* the paged cache is exact: interleaved sequences in one pool with shuffled blocks, and
  chunked prefill, give bit-identical logits to running alone / in one shot;
* quantized weights (int8, GGUF-native q4) stay close to fp32 in greedy text; their default
  integer-dot path (int8-quantized activations) stays close to fp32 activations and is exact
  under paging and chunked prefill like every other path.

These run in the default suite (no ``slow`` marker); a real-model test is skipped only when
the model is neither cached nor fetchable.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")  # rope_parameters, dtype=, ...
gguf = pytest.importorskip("gguf")

from equivalence_utils import (FP32, TINY_KINDS, PagedSeq, forward_chunks, gguf_path, new_cache,  # noqa: E402
                               random_prompt, run_ours, torch_threads)
from specserve.engine.model_runner import BatchEntry, build_forward_batch  # noqa: E402
from specserve.models.gguf_fields import GGUFArrayReader  # noqa: E402
from specserve.models.layers import linears  # noqa: E402
from specserve.models.loader import LoadedModel, load_model  # noqa: E402

ATOL = 1e-3
DECODE_STEPS = 32

PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "developed movable metal type in the German city of Mainz. Within a few decades, printing shops "
    "had spread to more than two hundred cities across Europe, books became far cheaper, and ideas "
    "travelled faster than ever before. Pamphlets, newspapers and scientific journals followed, and "
    "literacy rose steadily in the centuries after. Historians often argue that"
)
TOKENIZER_STRINGS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "def f(x):\n    return x ** 2  # comment",
    "Unicode: naïve café, 東京, emoji 🙂, numbers 1234567890.",
    PROMPT_TEXT,
]


# ---------------------------------------------------------------------------------------------
# driving our model through the paged cache
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def check_against_hf(lm: LoadedModel, hf, prompt: list[int], label: str) -> float:
    """The equivalence criteria; returns the max |logit difference|."""
    assert len(prompt) >= 64
    ours, greedy = run_ours(lm, prompt, DECODE_STEPS)
    ref = hf_logits(hf, prompt + greedy[:DECODE_STEPS])
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = (ours - ref).abs()
    max_diff = float(diff.max())
    scale = float(ref.abs().max())
    print(f"\n{label}: max |logit diff| {max_diff:.3g} over {ref.shape[0]} positions "
          f"(prompt {len(prompt)}, decode {DECODE_STEPS}); max |logit| {scale:.3g}")
    assert scale > 1.0, f"{label}: logits are all near zero, the comparison would be meaningless"
    assert max_diff <= ATOL, (f"{label}: max |logit diff| {max_diff:.3g} > {ATOL} (worst position "
                              f"{int(diff.max(dim=1).values.argmax())} of {ref.shape[0]})")
    theirs = hf_greedy(hf, prompt, DECODE_STEPS)
    assert greedy[:DECODE_STEPS] == theirs, f"{label}: greedy continuations differ:\n ours {greedy}\n hf   {theirs}"
    return max_diff


# ---------------------------------------------------------------------------------------------
# real GGUF models
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Run this module on one thread. The work here is small per op, and with 2 threads torch's and
    our kernels' OpenMP workers spin on each other (10-30x slower when the cores are shared);
    our kernels' results do not depend on the thread count."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module", autouse=True)
def _fast_gguf_loads():
    """Speed only, no change in results. Parsing a GGUF header (a 262k-token vocabulary) is the
    slowest part of every load and transformers parses each file three times (config, weights,
    tokenizer): share one read-only reader per file between all loaders in this module. And
    transformers rebuilds gguf's (pure) tensor-name map once per submodule: memoize it."""
    import gguf

    import specserve.models.gguf_fields  # noqa: F401  (subclasses the real reader: import it before the patch)

    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", shared_reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield
    readers.clear()


class RealModel:
    def __init__(self, name: str):
        self.name = name
        self.path = gguf_path(name)
        self.ours = load_model(name, FP32)
        # transformers' own GGUF loader (its names, permutations and config), reading the metadata
        # with the one-pass array reader (tests/test_gguf_fields.py: field for field the package's;
        # the package's own reader parses gemma3's 262K-token vocabulary element by element, twice)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf, "GGUFReader", GGUFArrayReader)
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(self.path.parent), gguf_file=self.path.name, dtype=torch.float32, attn_implementation="eager")
            self.hf_tok = transformers.AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        self.hf.eval()


@pytest.fixture(scope="module")
def smollm2() -> RealModel:
    return RealModel("smollm2-135m")


@pytest.fixture(scope="module")
def gemma3() -> RealModel:
    return RealModel("gemma3-270m")


def check_config(cfg, hc) -> None:
    """Our ModelConfig against the transformers config of the same checkpoint."""
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim) == (hc.vocab_size, hc.hidden_size, hc.intermediate_size,
                                                hc.num_hidden_layers, hc.num_attention_heads,
                                                hc.num_key_value_heads, head_dim)
    assert cfg.rms_eps == pytest.approx(hc.rms_norm_eps, rel=1e-6)
    assert cfg.tie_embeddings == hc.tie_word_embeddings
    rope = hc.rope_parameters
    types = getattr(hc, "layer_types", None) or ["full_attention"] * hc.num_hidden_layers
    for i, kind in enumerate(types):
        params = rope.get(kind, rope) if "full_attention" in rope else rope
        assert cfg.layer_rope_theta(i) == pytest.approx(params["rope_theta"]), f"rope base of layer {i}"
        window = getattr(hc, "sliding_window", None)
        sliding = kind == "sliding_attention" and bool(window)
        if hc.model_type == "mistral":
            sliding = bool(window)
        assert cfg.sliding(i) == sliding, f"layer {i}: sliding {cfg.sliding(i)}, transformers {kind}"
        if sliding:
            assert cfg.sliding_window == window
    if hc.model_type.startswith("gemma3"):
        assert cfg.scale == pytest.approx(hc.query_pre_attn_scalar ** -0.5)
        assert cfg.embed_scale == pytest.approx(hc.hidden_size ** 0.5)
        assert cfg.final_softcap == (hc.final_logit_softcapping or 0.0)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_gguf_matches_transformers(which, request):
    m: RealModel = request.getfixturevalue(which)
    check_config(m.ours.config, m.hf.config)
    # tokenizers agree (with and without the special tokens each side adds)
    for text in TOKENIZER_STRINGS:
        assert m.ours.tokenizer.encode(text, add_special_tokens=True) == m.hf_tok(text).input_ids, text
        assert m.ours.tokenizer.encode(text) == m.hf_tok(text, add_special_tokens=False).input_ids, text
    prompt = m.ours.tokenizer.encode(PROMPT_TEXT, add_special_tokens=True)
    check_against_hf(m.ours, m.hf, prompt, m.name)


def test_real_gemma3_sliding_window_matches_transformers(gemma3):
    """gemma3-270m's sliding layers see 512 tokens: a 530-token prompt crosses the window."""
    window = gemma3.ours.config.sliding_window
    prompt = gemma3.ours.tokenizer.encode(" ".join([PROMPT_TEXT] * 8), add_special_tokens=True)[:window + 18]
    assert len(prompt) == window + 18
    steps, keep = 3, 8
    lm = gemma3.ours
    nblocks = -(-(len(prompt) + steps) // 16)
    kv = new_cache(lm, nblocks, 16)
    seq = PagedSeq(list(range(nblocks)), 16)
    n = len(prompt)
    batch = build_forward_batch([BatchEntry(prompt, 0, [seq.blocks])], 16, nblocks, list(range(n - keep, n)),
                                torch.device("cpu"))
    rows = [lm.model.forward(batch, kv).logits]
    seq.length = n
    tokens = [int(rows[-1][-1].argmax())]
    for _ in range(steps):
        rows.append(forward_chunks(lm, kv, [(seq, [tokens[-1]])])[0])
        tokens.append(int(rows[-1][-1].argmax()))
    ours = torch.cat(rows)
    with torch.inference_mode():
        ref = gemma3.hf(torch.tensor([prompt + tokens[:steps]]), logits_to_keep=keep + steps).logits[0].float()
    max_diff = float((ours - ref).abs().max())
    print(f"\ngemma3-270m past the {window}-token window: max |logit diff| {max_diff:.3g} "
          f"over positions {n - keep}..{n + steps - 1}")
    assert max_diff <= ATOL


# ---------------------------------------------------------------------------------------------
# tiny random checkpoints written by transformers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_random_checkpoint_matches_transformers(kind, tiny_models):
    ours, hf = tiny_models(kind)
    cfg = ours.config
    check_config(cfg, hf.config)
    if kind.startswith("gemma3") or kind == "qwen2_sliding":
        assert cfg.sliding_window == 16 and any(cfg.layer_is_sliding) and not all(cfg.layer_is_sliding)
    if kind == "mistral":
        assert cfg.sliding_window == 16 and all(cfg.layer_is_sliding)
    if kind == "gemma3_softcap":
        # transformers' Gemma 3 ignores attn_logit_softcapping (so do we); final softcapping is real
        assert (cfg.final_softcap, cfg.attn_softcap, cfg.rope_scaling_factor) == (30.0, 0.0, 4.0)
    check_against_hf(ours, hf, random_prompt(72, seed=len(kind)), f"tiny {kind}")


# ---------------------------------------------------------------------------------------------
# paged attention is exact
# ---------------------------------------------------------------------------------------------

def _check_paged_exact(lm: LoadedModel, prompts: tuple[list[int], list[int]], steps: int = 5) -> None:
    bs = 4
    # each sequence alone, contiguous blocks, one-shot prefill
    alone = [run_ours(lm, p, steps, block_size=bs) for p in prompts]
    feeds = [toks[:steps] for _, toks in alone]

    # prefill in chunks of 7 gives the same bits as in one shot
    chunked, _ = run_ours(lm, prompts[0], steps, chunk=7, block_size=bs, feed=feeds[0])
    assert torch.equal(chunked, alone[0][0]), "chunked prefill differs from one-shot prefill"

    # both sequences interleaved in one pool, shuffled (non-contiguous) block ids
    need = [-(-(len(p) + steps) // bs) for p in prompts]
    ids = list(range(sum(need) + 5))
    random.Random(1234).shuffle(ids)
    kv = new_cache(lm, len(ids), bs)
    seqs = [PagedSeq(ids[:need[0]], bs), PagedSeq(ids[need[0]:need[0] + need[1]], bs)]
    assert seqs[0].blocks != sorted(seqs[0].blocks)
    got: list[list[torch.Tensor]] = [[], []]
    a, b = prompts
    cut_a, cut_b = len(a) // 3, len(b) // 2
    # pass 1: the start of A with the start of B; pass 2: B's rest first, then A's rest
    ra, rb = forward_chunks(lm, kv, [(seqs[0], a[:cut_a]), (seqs[1], b[:cut_b])])
    got[0].append(ra)
    got[1].append(rb)
    rb, ra = forward_chunks(lm, kv, [(seqs[1], b[cut_b:]), (seqs[0], a[cut_a:])])
    got[0].append(ra)
    got[1].append(rb)
    for i in range(steps):  # decode both in the same pass, alternating their order
        order = [0, 1] if i % 2 else [1, 0]
        rows = forward_chunks(lm, kv, [(seqs[j], [feeds[j][i]]) for j in order])
        for j, r in zip(order, rows):
            got[j].append(r)
    for j in range(2):
        assert torch.equal(torch.cat(got[j]), alone[j][0]), f"sequence {j}: paged/interleaved logits differ"


@pytest.mark.parametrize("kind", ["gemma3_softcap", "qwen2"])
def test_paged_attention_equals_dense_tiny(kind, tiny_models):
    ours, _ = tiny_models(kind)
    _check_paged_exact(ours, (random_prompt(45, 1), random_prompt(29, 2)))


@pytest.mark.parametrize("quant", ["q4", "int8"])
def test_paged_attention_equals_dense_smollm2_quantized(smollm2_quantized, quant):
    lm = smollm2_quantized(quant)
    lin = linears(lm.model.layers[0])[0]
    assert lin.format in (("Q4_1", "Q4_0", "Q4_K", "Q6_K", "Q8_0") if quant == "q4" else ("int8",))
    assert lin.weight.act_block == 32  # the integer-dot path (int8 activations) is what runs
    tok = lm.tokenizer
    _check_paged_exact(lm, (tok.encode(PROMPT_TEXT, add_special_tokens=True)[:37],
                            tok.encode("The capital of France is", add_special_tokens=True)), steps=3)


# ---------------------------------------------------------------------------------------------
# quantized weights stay close to fp32
# ---------------------------------------------------------------------------------------------

QUANT_STEPS = 64


def _prefix_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_quantized_formats_track_fp32(smollm2, smollm2_quantized):
    name = "smollm2-135m"
    prompt = smollm2.ours.tokenizer.encode("The capital of France is", add_special_tokens=True)
    _, ref = run_ours(smollm2.ours, prompt, QUANT_STEPS - 1)
    agreement = {}
    for quant in ("int8", "q4"):
        lm = smollm2_quantized(quant)
        _, got = run_ours(lm, prompt, QUANT_STEPS - 1)
        agreement[quant] = _prefix_agreement(ref, got)
        print(f"\n{name} {quant}: greedy agrees with fp32 for {agreement[quant]} of {QUANT_STEPS} tokens: "
              f"{lm.tokenizer.decode(got)!r}")
        if quant == "q4":
            # Teacher-forced on fp32's tokens, q4 ranks fp32's pick first or a close second for the
            # first 8 tokens. (Free-running prefix agreement is chaotic: q4 has a near-tie at token
            # 5 here -- 0.09 logit -- that ulp-level changes of the activations flip.)
            rows, _ = run_ours(lm, prompt, 8, feed=ref[:8])
            for i in range(8):
                r = rows[len(prompt) - 1 + i]
                top2 = r.topk(2).indices.tolist()
                assert ref[i] in top2 and float(r.max() - r[ref[i]]) < 0.5, (
                    f"q4 at token {i}: fp32 picks {ref[i]}, q4 ranks {top2}:\n"
                    f" fp32 {smollm2.ours.tokenizer.decode(ref)!r}\n q4   {lm.tokenizer.decode(got)!r}")


def _set_int_dot(lm: LoadedModel, on: bool) -> None:
    for lin in linears(lm.model):
        lin.weight.int_dot = on


@pytest.mark.parametrize("quant", ["q4", "int8"])
def test_int8_activations_track_fp32_activations(smollm2_quantized, quant):
    """The same weights with int8-quantized activations (integer dot products, the default) and
    with fp32 activations: logits over an 81-token prompt differ by ~3% (relative L2, measured
    3.1% for q4, 3.0% for int8 weights; top-1 agreement 99% / 90%), the rounding noise of 32-value
    activation blocks accumulated over 30 layers. A wrong block scale or integer sum gives O(1)."""
    lm = smollm2_quantized(quant)
    prompt = lm.tokenizer.encode(PROMPT_TEXT, add_special_tokens=True)
    try:
        _set_int_dot(lm, False)
        ref, _ = run_ours(lm, prompt, 0)
    finally:
        _set_int_dot(lm, True)
    got, _ = run_ours(lm, prompt, 0)
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"\nsmollm2-135m {quant}: int8 vs fp32 activations, mean relative L2 logit difference "
          f"{float(rel.mean()):.4f}, top-1 agreement {top1:.3f}")
    assert 1e-4 < float(rel.mean()) < 0.06 and top1 >= 0.85
