"""What the model-equivalence test modules share: driving our model through a paged KV cache
(sequences in a shared pool, chunked passes, greedy runs), and tiny random checkpoints written by
transformers (the configs of each family, their weights, a word-level tokenizer), built lazily."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
import torch
import transformers

from specserve.engine.model_runner import BatchEntry, build_forward_batch
from specserve.errors import ModelLoadError
from specserve.models.catalog import resolve_model
from specserve.models.loader import LoadedModel, LoadOptions, load_model
from specserve.models.transformer import ForwardBatch, KVCache

FP32 = LoadOptions(device="cpu", dtype="float32", quantization="none")


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class PagedSeq:
    """One sequence's place in a shared KV pool: its block ids and how many tokens are cached."""

    def __init__(self, blocks: list[int], block_size: int):
        self.blocks, self.block_size, self.length = list(blocks), block_size, 0

    def slots(self, n: int) -> list[int]:
        bs = self.block_size
        return [self.blocks[p // bs] * bs + p % bs for p in range(self.length, self.length + n)]


def paged_batch(parts: list[tuple[PagedSeq, list[int]]], hidden_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """One pass over several sequences' new tokens, logits for every row (advances each length)."""
    entries = [BatchEntry(toks, seq.length, [seq.blocks]) for seq, toks in parts]
    for seq, toks in parts:
        seq.length += len(toks)
    rows = sum(len(toks) for _, toks in parts)
    return build_forward_batch(entries, parts[0][0].block_size, max(len(s.blocks) for s, _ in parts),
                               list(range(rows)), torch.device("cpu"), hidden_layers)


def forward_chunks(lm: LoadedModel, kv: KVCache, parts: list[tuple[PagedSeq, list[int]]]) -> list[torch.Tensor]:
    """One forward pass over several sequences' chunks; returns each chunk's logits rows [n, V]."""
    logits = lm.model.forward(paged_batch(parts), kv).logits
    sizes = [len(toks) for _, toks in parts]
    return list(logits.split(sizes))


def new_cache(lm: LoadedModel, num_blocks: int, block_size: int) -> KVCache:
    return KVCache.allocate(lm.config, num_blocks, block_size, torch.float32, torch.device("cpu"))


def run_ours(lm: LoadedModel, prompt: list[int], steps: int, *, chunk: int = 0, block_size: int = 16,
             feed: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``prompt`` (in chunks of ``chunk`` tokens if set), then decode ``steps`` tokens one
    at a time. Decode inputs are our own greedy picks unless ``feed`` gives them. Returns the
    logits of every position [len(prompt) + steps, V] and the greedy tokens (steps + 1 of them)."""
    total = len(prompt) + steps + 1
    nblocks = -(-total // block_size)
    kv = new_cache(lm, nblocks, block_size)
    seq = PagedSeq(list(range(nblocks)), block_size)
    chunk = chunk or len(prompt)
    rows = [forward_chunks(lm, kv, [(seq, prompt[i:i + chunk])])[0] for i in range(0, len(prompt), chunk)]
    out = [int(rows[-1][-1].argmax())]
    for i in range(steps):
        tok = feed[i] if feed is not None else out[-1]
        rows.append(forward_chunks(lm, kv, [(seq, [tok])])[0])
        out.append(int(rows[-1][-1].argmax()))
    return torch.cat(rows), out


def gguf_path(name: str) -> Path:
    try:
        resolved = resolve_model(name, fetch=False)
    except ModelLoadError:
        try:
            resolved = resolve_model(name, fetch=True)
        except ModelLoadError as exc:
            pytest.skip(f"{name} is not cached and cannot be fetched: {exc}")
    assert resolved.kind == "gguf"
    return resolved.path


TINY_VOCAB = 320


def tiny_config(kind: str):
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind in ("llama", "llama_untied"):
        return transformers.LlamaConfig(num_hidden_layers=3, head_dim=24, tie_word_embeddings=kind == "llama",
                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **common)
    if kind == "mistral":  # our "llama" arch with every layer sliding
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=16, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                          **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(num_hidden_layers=3, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, **common)
    if kind == "qwen2_sliding":  # layers from max_window_layers on use a sliding window
        return transformers.Qwen2Config(num_hidden_layers=3, tie_word_embeddings=True, use_sliding_window=True,
                                        sliding_window=16, max_window_layers=1,
                                        rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, **common)
    if kind == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=3, head_dim=32, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    if kind.startswith("gemma3"):
        softcap = kind == "gemma3_softcap"
        full_rope = ({"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6} if softcap
                     else {"rope_type": "default", "rope_theta": 1e6})
        return transformers.Gemma3TextConfig(
            num_hidden_layers=5, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"],
            rope_parameters={"full_attention": full_rope,
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            final_logit_softcapping=30.0 if softcap else None, attn_logit_softcapping=20.0 if softcap else None,
            **common)
    raise ValueError(kind)


def randomize(model, gemma: bool, seed: int) -> None:
    """Weights large enough that logits are far from zero and greedy picks are decisive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:  # Gemma's norm is (1 + w): w itself must be far from 0
                p.copy_(0.5 * r if gemma else 1.0 + 0.3 * r)
            elif name.endswith("bias"):
                p.copy_(0.3 * r)
            elif "embed_tokens" in name:
                p.copy_((0.4 if gemma else 1.0) * r)
            else:
                p.copy_(r * (1.2 / p.shape[-1] ** 0.5))


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))


TINY_KINDS = ["llama", "llama_untied", "mistral", "qwen2", "qwen2_sliding", "qwen3", "gemma3", "gemma3_softcap"]


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


def tiny_model_builder(tmp_path_factory):
    """kind -> (our LoadedModel, transformers model), built lazily."""
    built: dict[str, tuple[LoadedModel, object]] = {}

    def get(kind: str):
        if kind not in built:
            cfg = tiny_config(kind)
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
            hf = hf.to(torch.float32).eval()
            if kind.startswith("gemma3"):
                assert isinstance(hf, transformers.Gemma3ForCausalLM)
            randomize(hf, kind.startswith("gemma3"), seed=TINY_KINDS.index(kind) + 1)
            if cfg.tie_word_embeddings:
                assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
            d = tmp_path_factory.mktemp(kind)
            hf.save_pretrained(d, safe_serialization=True)
            write_tokenizer(d, TINY_VOCAB)
            built[kind] = (load_model(str(d), FP32), hf)
        return built[kind]

    return get


def quantized_smollm2_builder():
    """quantization -> smollm2-135m loaded with those weights (cached per module)."""
    gguf_path("smollm2-135m")
    loaded: dict[str, LoadedModel] = {}

    def get(quant: str) -> LoadedModel:
        if quant not in loaded:
            loaded[quant] = load_model("smollm2-135m", LoadOptions(device="cpu", dtype="float32", quantization=quant))
        return loaded[quant]

    return get
