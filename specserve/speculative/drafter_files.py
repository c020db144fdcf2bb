"""A trained drafter's files: ``config.json`` (shapes, target identity, ...) and ``model.safetensors``
(float32, or int8 matrices with per-row scales), and the token counts that rank its draft
vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specserve.errors import SpecserveError
from specserve.kernels import ops


INT8_SCALE = ":scale"  # suffix of the per-row scale of a matrix stored in int8


def save_drafter(model: nn.Module, cfg_json: dict, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """config.json + model.safetensors. dtype torch.int8: every matrix as symmetric per-row int8
    (``name`` int8 [N, K] + ``name:scale`` float32 [N], the CPU kernels' Int8Weight layout, so
    the int8 inference path rebuilds the same weights); vectors stay float32."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().float()
        if dtype == torch.int8 and v.dim() == 2:
            w8 = ops.Int8Weight.from_float(v)
            tensors[k], tensors[k + INT8_SCALE] = w8.q, w8.scale
        else:
            tensors[k] = v.to(torch.float32 if dtype == torch.int8 else dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")


TOKEN_COUNTS = "token_counts.safetensors"


def save_token_counts(counts: torch.Tensor, out: Path) -> None:
    """[V] counts of the answer tokens a drafter was trained on (ranks its draft vocabulary; int32)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({"counts": counts.to(torch.int32).contiguous()}, str(out / TOKEN_COUNTS))
    (out / TOKEN_COUNTS).chmod(0o644)


def load_token_counts(directory: Path) -> torch.Tensor | None:
    from safetensors.torch import load_file

    path = directory / TOKEN_COUNTS
    return load_file(str(path))["counts"].to(torch.int64) if path.is_file() else None


def load_state(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg_path = directory / "config.json"
    if not cfg_path.is_file() or not (directory / "model.safetensors").is_file():
        raise SpecserveError(f"{directory} is not a drafter directory (needs config.json and model.safetensors)")
    cfg = json.loads(cfg_path.read_text())
    raw = load_file(str(directory / "model.safetensors"))
    state = {k: ops.Int8Weight(v, raw[k + INT8_SCALE]).dequantize() if k + INT8_SCALE in raw else v.float()
             for k, v in raw.items() if not k.endswith(INT8_SCALE)}
    return cfg, state
