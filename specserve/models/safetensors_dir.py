"""The tensors of a transformers checkpoint directory (``*.safetensors``, sharded or not), with
FP8 weights dequantized as they are read.

Two FP8 layouts:
- ``quantization_config.quant_method == "fp8"`` (Qwen's and DeepSeek's ``-FP8`` releases,
  transformers' FineGrainedFP8): a linear's weight as float8 and beside it
  ``<name>.weight_scale_inv``: one float per ``weight_block_size`` block (default 128 x 128; the
  grid is ceil(rows / block) x ceil(cols / block), so edge blocks may be short), or one for the
  whole tensor. MXFP8's scales come as uint8 exponents (``2 ** (byte - 127)``).
- ``"compressed-tensors"`` with ``format`` ``"float-quantized"`` (or ``"naive-quantized"``) and
  8-bit float weights (vLLM's and RedHat's ``-FP8`` / ``-FP8-dynamic`` checkpoints, made by
  llm-compressor): ``<name>.weight_scale`` per tensor ([1]), per output channel ([rows, 1]), per
  group of columns ([rows, cols / group]) or per block ([rows / bm, cols / bn]). Its activation
  scales (``input_scale``, ``k_scale``, ...) are for FP8 activations, which we do not use, and are
  skipped.
The weight is ``fp8 * scale``. The dequantized float32 then goes the way of any float checkpoint
(``--quantization`` picks our format). Other methods and formats (AWQ, GPTQ, bitsandbytes, int4 /
int8 compressed-tensors, ...) are refused at load, naming them, instead of read as garbage.
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
CHANNEL = (1, 1 << 40)  # one scale a row: a block one row high and wider than any weight
CT_SKIPPED = ("input_scale", "output_scale", "k_scale", "v_scale")  # compressed-tensors' activation scales


@dataclass(frozen=True)
class Fp8Layout:
    """Where an FP8 checkpoint's scales are (the weight's name + ``suffix``) and the block each
    covers (a per-tensor scale fits any block: it is told apart by its one element)."""

    suffix: str
    block: tuple[int, int]
    skipped: tuple[str, ...] = ()  # names ending so are not weights (activation scales): not listed


def quantization_layout(raw_cfg: dict, where: Path) -> Fp8Layout | None:
    """The FP8 layout of a checkpoint's config (None: not quantized). Raises ModelLoadError for a
    quantization this loader cannot read."""
    qc = raw_cfg.get("quantization_config") or raw_cfg.get("text_config", {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_layout(qc, where)
    if method != "fp8":
        raise ModelLoadError(f"{where}: quantization_config.quant_method {method!r} is not supported (only "
                             "'fp8' and 'compressed-tensors' with FP8 weights); load the unquantized checkpoint or "
                             "a GGUF (--quantization picks the format the weights run in)")
    return Fp8Layout(SCALE_SUFFIX, _block(qc.get("weight_block_size") or DEFAULT_BLOCK, "weight_block_size", where))


def _block(block, what: str, where: Path) -> tuple[int, int]:
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ModelLoadError(f"{where}: quantization_config {what} must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def _compressed_tensors_layout(qc: dict, where: Path) -> Fp8Layout:
    """compressed-tensors: every config group's weights 8-bit float, symmetric, one strategy."""
    fmt, groups = qc.get("format"), qc.get("config_groups") or {}
    refuse = (f"{where}: compressed-tensors format {fmt!r} is not supported (only FP8 weights: "
              "'float-quantized'); load the unquantized checkpoint or a GGUF")
    if fmt not in ("float-quantized", "naive-quantized") or not groups:
        raise ModelLoadError(refuse)
    blocks = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ModelLoadError(f"{refuse}: config group {name!r} has {w.get('num_bits')}-bit {w.get('type')} weights")
        if w.get("symmetric") is False:
            raise ModelLoadError(f"{where}: config group {name!r}: asymmetric FP8 weights (a zero point) are not "
                                 "supported")
        strategy = w.get("strategy")
        if strategy in ("tensor", "channel"):
            blocks.add(CHANNEL)  # (a per-tensor scale is one element: any block takes it)
        elif strategy == "group":
            blocks.add((1, _block([1, w.get("group_size")], "group_size", where)[1]))
        elif strategy == "block":
            blocks.add(_block(w.get("block_structure"), "block_structure", where))
        else:
            raise ModelLoadError(f"{where}: config group {name!r}: FP8 weight strategy {strategy!r} is not "
                                 "supported (tensor, channel, group, block)")
    if len(blocks) > 1:
        raise ModelLoadError(f"{where}: config groups with different FP8 weight strategies are not supported")
    return Fp8Layout("_scale", blocks.pop(), CT_SKIPPED)


class SafetensorsDir:
    """Tensor names -> tensors over every ``*.safetensors`` file of ``directory``; ``get`` returns a
    float8 weight dequantized with its scales (which may sit in another shard)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors files in {directory}")
        config = directory / "config.json"
        self.config: dict = json.loads(config.read_text()) if config.is_file() else {}  # (config.json as read)
        self.layout = quantization_layout(self.config, directory) or Fp8Layout(SCALE_SUFFIX, DEFAULT_BLOCK)
        self._where: dict[str, object] = {}  # tensor name -> its open file
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
                self._where.update({key: handle for key in handle.keys()})
            except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds on bad files
                raise ModelLoadError(f"cannot read {f}: corrupt or truncated ({exc})") from exc

    def keys(self) -> list[str]:
        """The checkpoint's tensor names, less the FP8 scales (read with their weights) and activation
        scales."""
        suffix, skipped = self.layout.suffix, self.layout.skipped
        return [k for k in self._where if not (k.endswith(suffix) and k[:-len(suffix)] in self._where)
                and not k.endswith(skipped)]

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
        scale_key = key + self.layout.suffix
        if scale_key not in self._where:
            raise ModelLoadError(f"{self.directory}: tensor {key} is {t.dtype} but the checkpoint has no "
                                 f"{scale_key} to scale it")
        return Fp8Weight(t, self._read(scale_key), self.layout.block, key)

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
        s = s.repeat_interleave(bm, dim=-2)[..., :rows, :] if bm > 1 else s
        return w * (s.repeat_interleave(bn, dim=-1)[..., :cols] if s.shape[-1] > 1 else s)  # one column: broadcast
