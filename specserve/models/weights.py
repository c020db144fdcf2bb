"""Read checkpoint tensors (GGUF or safetensors) under one naming scheme.

Internal names: ``embed``, ``norm``, ``lm_head`` and ``layers.{i}.{attn_norm, q, k, v, q_bias,
k_bias, v_bias, q_norm, k_norm, o, post_attn_norm, ffn_norm, gate, up, down, post_ffn_norm}``.
A :class:`RawTensor` keeps a GGUF tensor in its file layout so that quantized blocks can be
used as they are; ``dequantize()`` gives float32 for everything else.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.errors import ModelLoadError
from specserve.kernels.linear import DEQUANT_QTYPES, dequantize_blocks
from specserve.models.families import ModelFamily, family
from specserve.models.families.base import GGUF_TOP, HF_TOP
from specserve.models.safetensors_dir import Fp8Weight, SafetensorsDir

# quant types the gguf package can dequantize and we accept
SUPPORTED_GGUF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                        "Q4_K", "Q5_K", "Q6_K", "Q8_K"}

FLOAT_QTYPES = ("torch", "fp8", "F32", "F16", "BF16")


@dataclass
class RawTensor:
    """One checkpoint tensor: GGUF blocks (``qtype`` set) or a float tensor."""

    name: str
    shape: tuple[int, ...]  # logical shape, torch order ([out, in] for matrices)
    qtype: str  # "F32", "Q4_1", ... or "torch" for safetensors data, "fp8" for an FP8 checkpoint's
    data: object  # numpy uint8 [rows, row_bytes] / numpy float / torch tensor / Fp8Weight
    row_perm: np.ndarray | None = None  # output-row permutation to apply (llama q/k from GGUF)

    @property
    def is_float(self) -> bool:
        """Float data (no GGUF blocks to keep whole): its rows and columns are cut after dequantize()."""
        return self.qtype in FLOAT_QTYPES

    def dequantize(self) -> torch.Tensor:
        if self.qtype == "torch":
            out = self.data.to(torch.float32)
        elif self.qtype == "fp8":  # dequantized here, one tensor at a time, not at read
            out = self.data.dequantize()
        elif self.qtype in DEQUANT_QTYPES:  # the kernels' dequantizer: gguf-py's bits, many times faster
            k = self.shape[-1]
            with warnings.catch_warnings():  # a read-only mapping of the file: only read here
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(np.ascontiguousarray(self.data)).reshape(-1, np.shape(self.data)[-1])
            out = dequantize_blocks(raw, self.qtype, raw.shape[0], k).reshape(self.shape)
        else:
            import gguf

            arr = gguf.quants.dequantize(np.asarray(self.data), gguf.GGMLQuantizationType[self.qtype])
            out = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).reshape(self.shape)
        if self.row_perm is not None:
            out = out[torch.from_numpy(self.row_perm)]
        return out.contiguous()

    def raw_rows(self) -> torch.Tensor:
        """The GGUF block bytes as uint8 [rows, row_bytes], rows permuted if needed."""
        raw = torch.from_numpy(np.array(self.data, copy=True))
        if self.row_perm is not None:
            raw = raw[torch.from_numpy(self.row_perm)]
        return raw.contiguous()


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (interleaved -> half-split rope)."""
    head_dim = n_rows // n_head
    idx = np.arange(n_rows).reshape(n_head, head_dim // 2, 2)
    return idx.transpose(0, 2, 1).reshape(-1)


def gguf_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.model",
                "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - an unreadable field is not needed by us
            continue
    return meta


def check_gguf_header(path: Path, versions: list[int]) -> None:
    """A file that is not GGUF, or a GGUF version the reader does not know, named as such
    (the reader's own errors read like a damaged file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(head) < 8 or head[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    version = int.from_bytes(head[4:], "little")
    if version not in versions and int.from_bytes(head[4:], "big") not in versions:  # big-endian files exist
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported "
                             f"(the gguf package reads versions {', '.join(map(str, versions))})")


def open_gguf(path: Path):
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    from specserve.models.gguf_fields import GGUFArrayReader

    check_gguf_header(path, list(READER_SUPPORTED_VERSIONS))
    try:
        return GGUFArrayReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the reader raises many kinds on bad files
        raise ModelLoadError(f"cannot read GGUF file {path}: corrupt or truncated ({type(exc).__name__}: {exc})") from exc


# matrices of one row that ggml writes as vectors (it drops a trailing dimension of 1: llama-quantize's
# files): the shared expert's gate [1, H] of Qwen3-Next / Qwen3.5-MoE
GGUF_ONE_ROW = ("ffn_gate_inp_shexp",)


def gguf_shape(t) -> tuple[int, ...]:
    """A GGUF tensor's logical shape in torch order ([out, in]), its one-row matrices as matrices."""
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))
    if len(shape) == 1 and re.fullmatch(rf"blk\.\d+\.(?:{'|'.join(GGUF_ONE_ROW)})\.weight", t.name):
        return (1, shape[0])
    return shape


def _gguf_name(name: str, fam: ModelFamily) -> str | None:
    base = name.removesuffix(".weight").removesuffix(".bias")
    suffix = "_bias" if name.endswith(".bias") else ""
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)", base)
    if m:
        local = fam.gguf_layer_name(m.group(2))
        return None if local is None else f"layers.{m.group(1)}.{local}{suffix}"
    return GGUF_TOP.get(base)


def check_tensor_types(reader) -> None:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise ModelLoadError("unsupported rope scaling: this GGUF carries rope_freqs (Llama 3.1-style scaling)")
        if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(f"unsupported GGUF quantization type {t.tensor_type.name} (tensor {t.name}); "
                                 f"supported: {', '.join(sorted(SUPPORTED_GGUF_TYPES))}")


def read_gguf_tensors(reader, arch: str, num_heads: int, num_kv_heads: int) -> dict[str, RawTensor]:
    fam = family(arch)
    permute_qk = fam.gguf_permute_qk
    out: dict[str, RawTensor] = {}
    for t in reader.tensors:
        name = _gguf_name(t.name, fam)
        if name is None:
            continue
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(f"unsupported GGUF quantization type {qtype} (tensor {t.name})")
        shape = gguf_shape(t)
        perm = None
        if permute_qk and re.search(r"\.(q|k)(_bias)?$", name):
            perm = _unpermute_rows(shape[0], num_heads if name.endswith((".q", ".q_bias")) else num_kv_heads)
        out[name] = RawTensor(name, shape, qtype, t.data, perm)
    return out


def _hf_name(name: str, fam: ModelFamily) -> str | None:
    name = name.replace("model.language_model.", "model.")  # the text part of a multimodal checkpoint
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(?:\.(weight|bias))?", name)
    if m:
        experts = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj", m.group(2))  # mixture of experts
        if experts:
            return f"layers.{m.group(1)}.expert{experts.group(1)}.{experts.group(2)}"
        local = fam.hf_layer_name(m.group(2))  # parameters without a .weight suffix: A_log, dt_bias
        if local is None:
            return None
        return f"layers.{m.group(1)}.{local}" + ("_bias" if m.group(3) == "bias" else "")
    return HF_TOP.get(name.removesuffix(".weight"))


def read_safetensors(directory: Path, arch: str) -> dict[str, RawTensor]:
    """The family's tensors of a transformers checkpoint under internal names (FP8 weights
    dequantized: models/safetensors_dir.py)."""
    files = SafetensorsDir(directory)
    out: dict[str, RawTensor] = {}
    fam = family(arch)
    for key in files.keys():
        name = _hf_name(key, fam)
        if name is not None:
            t = files.get_lazy(key)
            out[name] = RawTensor(name, tuple(t.shape), "fp8" if isinstance(t, Fp8Weight) else "torch", t)
    return out


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{directory} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
