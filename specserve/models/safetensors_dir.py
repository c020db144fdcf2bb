"""The tensors of a transformers checkpoint directory (``*.safetensors``, sharded or not), with
FP8 weights dequantized as they are read.

FP8 checkpoints (``quantization_config.quant_method == "fp8"``: Qwen's and DeepSeek's ``-FP8``
releases, transformers' FineGrainedFP8) store a linear's weight as float8 and beside it
``<name>.weight_scale_inv``: one float per ``weight_block_size`` block (default 128 x 128; the
grid is ceil(rows / block) x ceil(cols / block), so edge blocks may be short), or one for the
whole tensor. The weight is ``fp8 * scale_inv``; MXFP8's scales come as uint8 exponents
(``2 ** (byte - 127)``). The dequantized float32 then goes the way of any float checkpoint
(``--quantization`` picks our format). Other ``quant_method``s (AWQ, GPTQ, bitsandbytes,
compressed-tensors, ...) are refused at load, naming the method, instead of read as garbage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import ModelLoadError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


def quantization_block(raw_cfg: dict, where: Path) -> tuple[int, int] | None:
    """The FP8 block shape of a checkpoint's config (None: not quantized). Raises ModelLoadError for
    a quantization method this loader cannot read."""
    qc = raw_cfg.get("quantization_config") or raw_cfg.get("text_config", {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(f"{where}: quantization_config.quant_method {method!r} is not supported (only "
                             "'fp8', block-wise FP8 weights); load the unquantized checkpoint or a GGUF "
                             "(--quantization picks the format the weights run in)")
    block = qc.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ModelLoadError(f"{where}: quantization_config.weight_block_size must be two positive integers, "
                             f"got {block!r}")
    return int(block[0]), int(block[1])


class SafetensorsDir:
    """Tensor names -> tensors over every ``*.safetensors`` file of ``directory``; ``get`` returns a
    float8 weight dequantized with its ``_scale_inv`` (which may sit in another shard)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors files in {directory}")
        config = directory / "config.json"
        raw_cfg = json.loads(config.read_text()) if config.is_file() else {}
        self.block = quantization_block(raw_cfg, directory) or DEFAULT_BLOCK
        self._where: dict[str, object] = {}  # tensor name -> its open file
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
                self._where.update({key: handle for key in handle.keys()})
            except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds on bad files
                raise ModelLoadError(f"cannot read {f}: corrupt or truncated ({exc})") from exc

    def keys(self) -> list[str]:
        """The checkpoint's tensor names, less the FP8 scales (read with their weights)."""
        return [k for k in self._where if not (k.endswith(SCALE_SUFFIX) and k[:-len(SCALE_SUFFIX)] in self._where)]

    def get(self, key: str) -> torch.Tensor:
        """The tensor as stored, or an FP8 weight dequantized to float32."""
        t = self.get_lazy(key)
        return t.dequantize() if isinstance(t, Fp8Weight) else t

    def get_lazy(self, key: str) -> torch.Tensor | Fp8Weight:
        """The tensor as stored, or an FP8 weight with its scales, dequantized when asked (a model's
        weights are then float32 one at a time, not all at once)."""
        t = self._read(key)
        if t.dtype not in FP8_DTYPES:
            return t
        scale_key = key + SCALE_SUFFIX
        if scale_key not in self._where:
            raise ModelLoadError(f"{self.directory}: tensor {key} is {t.dtype} but the checkpoint has no "
                                 f"{scale_key} to scale it")
        return Fp8Weight(t, self._read(scale_key), self.block, key)

    def _read(self, key: str) -> torch.Tensor:
        try:
            return self._where[key].get_tensor(key)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"cannot read tensor {key} in {self.directory}: corrupt or truncated "
                                 f"({exc})") from exc


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 checkpoint's weight [..., rows, cols] and its scales: one per tensor, or a grid of
    ``block`` blocks [..., ceil(rows / bm), ceil(cols / bn)] (stacked experts keep their leading dims).
    A scale shape that fits neither is a ModelLoadError here, at load."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    name: str

    def __post_init__(self) -> None:
        if self.scale.numel() == 1:
            return
        if self.weight.dim() < 2:
            raise ModelLoadError(f"tensor {self.name}: an FP8 tensor of shape {tuple(self.weight.shape)} needs "
                                 f"one scale, has {tuple(self.scale.shape)}")
        (rows, cols), (bm, bn) = self.weight.shape[-2:], self.block
        grid = (*self.weight.shape[:-2], -(-rows // bm), -(-cols // bn))
        if tuple(self.scale.shape) != grid:
            raise ModelLoadError(f"tensor {self.name}: scale shape {tuple(self.scale.shape)} does not match its "
                                 f"weight {tuple(self.weight.shape)} in {bm} x {bn} blocks (expected {grid})")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        """float32 weight: fp8 times its block's scale (MXFP8's uint8 scales are exponents: 2 ** (s - 127))."""
        s = self.scale
        s = (s.to(torch.float32) - 127.0).exp2() if s.dtype == torch.uint8 else s.to(torch.float32)
        w = self.weight.to(torch.float32)
        if s.numel() == 1:
            return w * s.reshape(())
        (rows, cols), (bm, bn) = w.shape[-2:], self.block
        return w * s.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
