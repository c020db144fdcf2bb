"""Reading an MTP head out of a checkpoint: the safetensors ``mtp.*`` / ``model.mtp.*`` tensors
(Qwen3-Next / Qwen3.5 names, DeepSeek's accepted too; a dense or mixture-of-experts layer) or a
GGUF's ``blk.{N}.nextn.*`` block, under the names of :class:`~specserve.speculative.mtp.MTPModel`'s
parameters, and the head's config from their shapes and the target's config."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from specserve.errors import SpecserveError
from specserve.models.families import families
from specserve.models.families.base import GGUF_LAYER, HF_LAYER
from specserve.models.loader import LoadedModel
from specserve.speculative.layers import target_identity

# the MTP layer's parameters, named as the target's layers are (the family maps, prefixed "layer.")
_LAYER_PARAMS = ("attn_norm", "ffn_norm", "q", "k", "v", "o", "q_norm", "k_norm", "gate", "up", "down")
_HF_LAYER = {k: f"layer.{v}" for k, v in HF_LAYER.items()
             if v in _LAYER_PARAMS and k not in ("pre_feedforward_layernorm", "post_feedforward_layernorm")}
_HF_TOP = {
    "fc": "eh_proj", "eh_proj": "eh_proj", "pre_fc_norm_embedding": "enorm", "enorm": "enorm",
    "pre_fc_norm_hidden": "hnorm", "hnorm": "hnorm", "norm": "norm", "shared_head.norm": "norm",
}
_GGUF_LAYER = {
    **{k: f"layer.{v}" for k, v in GGUF_LAYER.items() if v in _LAYER_PARAMS},
    "nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm", "nextn.shared_head_norm": "norm",
}
_UNSUPPORTED = re.compile(r"(q_a_proj|kv_a_proj|kv_b_proj|attn_kv_a)")
_GGUF_MOE = {"ffn_gate_inp": "router", "ffn_gate_inp_shexp": "shared_gate", "ffn_gate_shexp": "shared.gate",
             "ffn_up_shexp": "shared.up", "ffn_down_shexp": "shared.down", "ffn_gate_exps": "gate",
             "ffn_up_exps": "up", "ffn_down_exps": "down"}
_HF_MOE = ((re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj"), r"layer.moe.experts.\1.\2"),
           (re.compile(r"mlp\.gate"), "layer.moe.router"),
           (re.compile(r"mlp\.shared_expert\.(gate|up|down)_proj"), r"layer.moe.shared.\1"),
           (re.compile(r"mlp\.shared_expert_gate"), "layer.moe.shared_gate"))
# Qwen3-Next style checkpoints store norms as (w - 1) ("zero-centred"): add 1 back
_OFFSET_NORMS = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "gemma3", "gemma3_text")


def _map_hf_name(key: str, n_layers: int | None) -> str | None:
    """A safetensors key of an MTP head -> our parameter name (None: not an MTP tensor)."""
    base, suffix = key.rsplit(".", 1) if key.endswith((".weight", ".bias")) else (key, "weight")
    for prefix in ("model.mtp.", "mtp."):
        if base.startswith(prefix):
            rest = base[len(prefix):]
            rest = re.sub(r"^layers\.0\.", "", rest)
            break
    else:
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
        if not m or n_layers is None or int(m.group(1)) != n_layers:
            return None
        rest = m.group(2)
    if _UNSUPPORTED.search(key):
        raise SpecserveError(f"MTP tensor {key}: MLA MTP layers are not supported")
    moe = next((pat.sub(to, rest) for pat, to in _HF_MOE if pat.fullmatch(rest)), None)
    name = moe or _HF_LAYER.get(rest) or _HF_TOP.get(rest)
    if name is None:
        return None  # embed_tokens / shared_head.head: the target's are used
    if suffix == "bias":
        return f"{name}.bias"
    return name if name.endswith("norm") else f"{name}.weight"


def _read_hf_mtp(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from specserve.models.safetensors_dir import SafetensorsDir

    files = SafetensorsDir(directory)
    text = files.config.get("text_config", files.config)
    n_layers = text.get("num_hidden_layers")
    state: dict[str, torch.Tensor] = {}
    for key in files.keys():
        name = _map_hf_name(key, n_layers)
        if name is not None:
            state[name] = files.get(key).float()
    if state and text.get("model_type") in _OFFSET_NORMS:
        for k in list(state):
            if k.endswith("norm"):
                state[k] = state[k] + 1.0
    return state, text


def _read_gguf_mtp(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from specserve.models import weights as mweights

    reader = mweights.open_gguf(path)
    meta = mweights.gguf_metadata(reader)
    arch = meta.get("general.architecture")
    blocks = [int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.nextn\.", t.name))]
    if not blocks:
        return {}, meta
    n = min(blocks)  # the first MTP block (block_count - nextn_predict_layers)
    heads = int(meta.get(f"{arch}.attention.head_count", 0) or 0)
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads) or heads)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        m = re.fullmatch(rf"blk\.{n}\.(.+)\.(weight|bias)", t.name)
        if not m:
            continue
        part = m.group(1)
        shape = mweights.gguf_shape(t)
        if part in _GGUF_MOE:  # a mixture-of-experts layer (Qwen3-Next): the experts merged in 3-D tensors
            w = mweights.RawTensor(t.name, shape, t.tensor_type.name, t.data).dequantize()
            if part.endswith("_exps"):
                for e in range(shape[0]):
                    state[f"layer.moe.experts.{e}.{_GGUF_MOE[part]}.weight"] = w[e]
            else:
                state[f"layer.moe.{_GGUF_MOE[part]}.weight"] = w
            continue
        if _UNSUPPORTED.search(t.name):
            raise SpecserveError(f"MTP tensor {t.name}: MLA MTP layers are not supported")
        own = families().get(arch).gguf_layer_name(part) if arch in families() else None  # the family's names
        name = f"layer.{own}" if own in _LAYER_PARAMS else _GGUF_LAYER.get(part)
        if name is None:
            continue
        perm = None
        fam = families().get(arch)
        if fam and fam.gguf_permute_qk and name in ("layer.q", "layer.k") and heads:  # undo llama.cpp's permutation
            perm = mweights._unpermute_rows(shape[0], heads if name == "layer.q" else kv_heads)
        w = mweights.RawTensor(t.name, shape, t.tensor_type.name, t.data, perm).dequantize()
        if m.group(2) == "bias":
            state[f"{name}.bias"] = w
        elif name.endswith("norm"):
            state[name] = w.reshape(-1)
        else:
            state[f"{name}.weight"] = w
    return state, meta


def read_checkpoint_mtp(path: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """MTP head tensors (our names) found in a checkpoint file or directory; {} if none."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf" or (path.is_file() and path.read_bytes()[:4] == b"GGUF"):
        state, _ = _read_gguf_mtp(path)
    elif path.is_dir() and any(path.glob("*.safetensors")):
        state, _ = _read_hf_mtp(path)
    elif path.is_dir() and len(list(path.glob("*.gguf"))) == 1:
        path = next(path.glob("*.gguf"))
        state, _ = _read_gguf_mtp(path)
    else:
        return {}, str(path)
    return state, str(path)


def config_from_state(state: dict[str, torch.Tensor], target: LoadedModel, source: str):
    """The MTPConfig of a checkpoint's head (its tensors' shapes, the target's config)."""
    from specserve.speculative.mtp import MTPConfig

    c = target.config
    moe = "layer.moe.router.weight" in state
    if moe and c.moe is None:
        raise SpecserveError(f"MTP head in {source} has a mixture-of-experts layer; {target.name} has none")
    mlp = ("layer.moe.router.weight",) if moe else ("layer.gate.weight",)
    need = ("eh_proj.weight", "enorm", "hnorm", "layer.q.weight", "layer.k.weight", *mlp)
    missing = [n for n in need if n not in state]
    if missing:
        raise SpecserveError(f"MTP head in {source} is incomplete: missing {missing}")
    H = c.hidden_size
    if tuple(state["eh_proj.weight"].shape) != (H, 2 * H):
        raise SpecserveError(f"MTP head in {source}: eh_proj is {tuple(state['eh_proj.weight'].shape)}, "
                             f"expected {(H, 2 * H)} for {target.name}")
    head_dim, gated = c.head_dim, c.attn_output_gate  # a hybrid target's MTP layer is its gated attention
    m = c.moe
    return MTPConfig(H, state["layer.q.weight"].shape[0] // (head_dim * (2 if gated else 1)),
                     state["layer.k.weight"].shape[0] // head_dim, head_dim,
                     0 if moe else state["layer.gate.weight"].shape[0], c.rms_eps, c.rope_theta,
                     "layer.q_norm" in state, "layer.q.bias" in state, target=target_identity(target), source=source,
                     output_gate=gated, rotary_dim=c.rotary_dim, mrope_section=list(c.mrope_section) or None,
                     moe=[m.num_experts, m.num_experts_per_tok, m.intermediate_size, m.shared_intermediate_size,
                          m.norm_topk_prob] if moe else None)
