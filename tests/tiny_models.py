"""Tiny random models built in the test process (no download): a byte-level tokenizer and a
3-layer Llama saved with transformers and loaded by our loader."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specserve.models.loader import LoadOptions, load_model

FP32 = LoadOptions(device="cpu", quantization="none")
TINY_VOCAB = 320
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_byte_tokenizer(directory: Path, merges: tuple[tuple[str, str], ...] = ()) -> None:
    """A byte-level tokenizer (256 byte tokens, one per merge, then the chat specials) with a chat
    template. (A GGUF of a vocabulary without merges cannot be read back by transformers.)"""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({a + b: len(alphabet) + i for i, (a, b) in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab, list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))


def make_tiny_target(directory: Path, seed: int = 0, layers: int = 3):
    """A tiny random Llama saved with save_pretrained and loaded by our loader (fp32)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   num_hidden_layers=layers, max_position_embeddings=1024, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, bos_token_id=None, eos_token_id=257, pad_token_id=0)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r * (1.2 / p.shape[-1] ** 0.5))
    directory.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(directory, safe_serialization=True)
    write_byte_tokenizer(directory)
    return load_model(str(directory), FP32)


HYBRID_MERGES = (("Ġ", "t"),)  # one merge: token 256; <|im_start|> 257, <|im_end|> 258
HYBRID_EOS = 258


def tiny_hybrid_config(kind: str = "qwen3_5", **over):
    """A tiny Qwen3.5 text config: every layer type, GQA in both attention kinds, conv kernel 4."""
    import transformers

    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True},
              bos_token_id=None, eos_token_id=HYBRID_EOS, pad_token_id=0)
    kw.update(over)
    return transformers.Qwen3_5TextConfig(**kw)


def randomize_hybrid(hf, seed: int) -> None:
    """Random weights large enough that every input matters: zero-centred norms around 0 (they
    are 1 + w), the gated output norm around 1, decays exp(-A) with A in 0.5..8.5."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * r)
            elif "norm" in name:
                p.copy_(0.3 * r)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 0.5))
            elif name.endswith("dt_bias") or "embed_tokens" in name or name.endswith("mlp.gate.weight"):
                p.copy_(r)  # (mlp.gate: a mixture of experts' router)
            elif "conv1d" in name:
                p.copy_(0.5 * r)
            else:
                p.copy_(r * (1.2 / p.shape[-1] ** 0.5))


def make_tiny_hybrid(directory: Path, seed: int = 0, options: LoadOptions = FP32, mtp: bool = True, **over):
    """A tiny random Qwen3_5ForCausalLM saved with save_pretrained and loaded by our loader; the
    transformers model is returned too (the oracle)."""
    import transformers

    return _save_random(transformers.Qwen3_5ForCausalLM, tiny_hybrid_config(**over), directory, seed, options, mtp)


def mtp_shapes(hf) -> dict[str, tuple[int, ...]]:
    """The checkpoint's MTP head (``mtp.*``, one layer): the fc over [norm(embedding), norm(hidden)],
    its two norms, a gated full-attention decoder layer named like the model's, a final norm."""
    full = hf.config.layer_types.index("full_attention")
    shapes = {"mtp.fc.weight": (hf.config.hidden_size, 2 * hf.config.hidden_size)}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        shapes[f"mtp.{n}.weight"] = (hf.config.hidden_size,)
    for name, p in hf.model.layers[full].named_parameters():
        if name == "mlp.experts.gate_up_proj":  # a MoE layer: checkpoints store one tensor per expert
            e, two_i, h = p.shape
            for j in range(e):
                shapes[f"mtp.layers.0.mlp.experts.{j}.gate_proj.weight"] = (two_i // 2, h)
                shapes[f"mtp.layers.0.mlp.experts.{j}.up_proj.weight"] = (two_i // 2, h)
        elif name == "mlp.experts.down_proj":
            for j in range(p.shape[0]):
                shapes[f"mtp.layers.0.mlp.experts.{j}.down_proj.weight"] = tuple(p.shape[1:])
        else:
            shapes[f"mtp.layers.0.{name}"] = tuple(p.shape)
    return shapes


def add_mtp_tensors(directory: Path, hf, seed: int) -> None:
    """Random mtp.* tensors added to a saved checkpoint (transformers' model has no MTP module;
    the released checkpoints carry these tensors beside the model's). hf: a causal LM, or an
    image-text model (its language model's layers; the count goes into text_config)."""
    from types import SimpleNamespace

    vl = hasattr(hf.model, "language_model")
    if vl:
        hf = SimpleNamespace(config=hf.config.text_config, model=hf.model.language_model)
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    f = directory / "model.safetensors"
    tensors = load_file(str(f))
    for name, shape in mtp_shapes(hf).items():
        r = torch.randn(shape, generator=g)
        tensors[name] = 0.3 * r if "norm" in name else r * (1.2 / shape[-1] ** 0.5)
    save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    if vl:
        cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}, indent=2))


def make_tiny_qwen3_next(directory: Path, seed: int = 0, options: LoadOptions = FP32, mtp: bool = False, **over):
    """A tiny random Qwen3NextForCausalLM (sparse MoE layers with a shared expert, one dense
    layer, GQA in both attention kinds) saved with save_pretrained, loaded by our loader; the
    transformers model is returned too."""
    import transformers

    cfg = transformers.Qwen3NextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[3],
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=None, eos_token_id=HYBRID_EOS, pad_token_id=0)
    for k, v in over.items():
        setattr(cfg, k, v)
    return _save_random(transformers.Qwen3NextForCausalLM, cfg, directory, seed, options, mtp)


def _save_random(model_cls, cfg, directory: Path, seed: int, options: LoadOptions, mtp: bool):
    """A random ``model_cls(cfg)`` saved with save_pretrained (mtp.* added if ``mtp``) beside the hybrid
    tests' tokenizer, loaded by our loader: (ours, transformers')."""
    torch.manual_seed(seed)
    hf = model_cls(cfg).eval()
    randomize_hybrid(hf, seed + 1)
    directory.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(directory, safe_serialization=True)
    if mtp:
        add_mtp_tensors(directory, hf, seed + 2)
    write_byte_tokenizer(directory, HYBRID_MERGES)
    return load_model(str(directory), options), hf


def make_tiny_qwen3_5_moe(directory: Path, seed: int = 0, options: LoadOptions = FP32, mtp: bool = True,
                          shared_intermediate: int = 48):
    """A tiny random Qwen3_5MoeForCausalLM (Qwen3.5's layers, a sparse MoE MLP with a shared expert in
    every layer, the MTP head's layer a MoE one too) saved with save_pretrained, loaded by our loader;
    the transformers model is returned too. The routed experts' width is 32."""
    import transformers

    cfg = tiny_moe_text_config(shared_intermediate)
    return _save_random(transformers.Qwen3_5MoeForCausalLM, cfg, directory, seed, options, mtp)


def tiny_moe_text_config(shared_intermediate: int = 48):
    """The tiny hybrid's text config with a MoE MLP in every layer: 4 experts of 32, 2 a token."""
    import transformers

    kw = {k: v for k, v in tiny_hybrid_config().to_dict().items()
          if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                   "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings", "rms_norm_eps",
                   "tie_word_embeddings", "layer_types", "rope_parameters", "eos_token_id", "pad_token_id")}
    return transformers.Qwen3_5MoeTextConfig(**kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=shared_intermediate, bos_token_id=None)


# vision: specials after the chat ones (<|im_start|> 257, <|im_end|> 258)
VL_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # 259 .. 262
VL_IDS = dict(vision_start_token_id=259, vision_end_token_id=260, image_token_id=261, video_token_id=262)
VL_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "temporal_patch_size": 2,
                   "merge_size": 2, "do_resize": True, "do_rescale": True, "do_normalize": True,
                   "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                   "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}}


def tiny_vl_config(moe: bool = False, **text_over):
    """A tiny Qwen3.5 image-text config: the tiny hybrid text model (``moe``: its MoE form) and a
    2-block vision tower with 8-pixel patches and a 6 x 6 learned position grid."""
    import transformers

    vision = dict(depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=48, num_heads=2,
                  in_channels=3, patch_size=8, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                  num_position_embeddings=36)
    if moe:
        return transformers.Qwen3_5MoeConfig(text_config=tiny_moe_text_config().to_dict(), vision_config=vision,
                                             tie_word_embeddings=False, **VL_IDS)
    return transformers.Qwen3_5Config(text_config=tiny_hybrid_config(**text_over).to_dict(),
                                      vision_config=vision, tie_word_embeddings=False, **VL_IDS)


def write_vl_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    write_byte_tokenizer(directory, HYBRID_MERGES)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True) for s in VL_SPECIALS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "preprocessor_config.json").write_text(json.dumps(VL_PREPROCESSOR, indent=1))


def make_tiny_vl(directory: Path, seed: int = 0, mtp: bool = True, moe: bool = False, **text_over):
    """A tiny random Qwen3_5ForConditionalGeneration (model.visual.* + model.language_model.*;
    ``moe``: Qwen3_5MoeForConditionalGeneration, as Qwen3.5-35B-A3B), saved with save_pretrained
    beside a byte tokenizer with the vision specials and a preprocessor_config.json; returns the
    transformers model (the oracle)."""
    import transformers

    torch.manual_seed(seed)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    hf = cls(tiny_vl_config(moe, **text_over)).eval()
    randomize_hybrid(hf, seed + 1)
    directory.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(directory, safe_serialization=True)
    if mtp:
        add_mtp_tensors(directory, hf, seed + 2)
    write_vl_tokenizer(directory)
    return hf


def write_fp8_copy(src: Path, dst: Path, block: tuple[int, int] | str, skip: tuple[str, ...] = ("norm", "embed", "lm_head"),
                   scale_dtype: torch.dtype = torch.float32, layout: str = "fp8") -> list[str]:
    """Copy a transformers checkpoint as an FP8 one: every 2-D weight (names in ``skip`` aside) as
    float8_e4m3fn with a scale per ``block`` block (amax / 448; a ceil(rows / bm) x ceil(cols / bn)
    grid), and quantization_config in config.json. layout "fp8": as Qwen's -FP8 releases are written
    (``weight_scale_inv``); "compressed-tensors": as llm-compressor writes FP8 (``weight_scale``, a
    static ``input_scale`` beside it), with ``block`` a (bm, bn) block or "tensor", "channel", or
    ("group", size). Returns the names quantized."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    done = []
    for f in dst.glob("*.safetensors"):
        out = {}
        for key, w in load_file(str(f)).items():
            if w.dim() != 2 or not key.endswith(".weight") or any(s in key for s in skip):
                out[key] = w
                continue
            (r, c), (bm, bn) = w.shape, _fp8_block(block, *w.shape)
            gr, gc = -(-r // bm), -(-c // bn)  # edge blocks may be short: pad them with zeros
            padded = torch.nn.functional.pad(w.float(), (0, gc * bn - c, 0, gr * bm - r))
            blocks = padded.reshape(gr, bm, gc, bn)
            scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12).to(scale_dtype)
            q = (blocks / scale.float()[:, None, :, None]).reshape(gr * bm, gc * bn)[:r, :c]
            out[key] = q.to(torch.float8_e4m3fn)
            if layout == "fp8":
                out[key + "_scale_inv"] = scale
            else:
                out[key + "_scale"] = scale.reshape(1) if block == "tensor" else scale
                out[key[:-len("weight")] + "input_scale"] = torch.tensor([0.05])
            done.append(key)
        save_file(out, str(f), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": list(block), "fmt": "e4m3"} if layout == "fp8" else
                                  compressed_tensors_config(block))
    (dst / "config.json").write_text(json.dumps(cfg))
    return done


def _fp8_block(block, rows: int, cols: int) -> tuple[int, int]:
    if block == "tensor":
        return rows, cols
    if block == "channel":
        return 1, cols
    if block[0] == "group":
        return 1, block[1]
    return block


def compressed_tensors_config(block) -> dict:
    """llm-compressor's quantization_config for FP8 weights (static FP8 activations beside them)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "observer": "minmax"}
    if block in ("tensor", "channel"):
        weights["strategy"] = block
    elif block[0] == "group":
        weights.update(strategy="group", group_size=block[1])
    else:
        weights.update(strategy="block", block_structure=list(block))
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}}}
