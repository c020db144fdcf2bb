"""The Qwen3.5 vision tower (``model.visual.*``): pixel patches in, image-token embeddings out.

The maths of transformers' Qwen3_5VisionModel, for one image at a time, in fp32:

1. patch embedding: a Conv3d whose stride equals its kernel [T, P, P], i.e. one matmul of each
   flattened [C*T*P*P] patch with the kernel flattened the same way;
2. learned absolute positions: the square [side, side] table resampled to the image's [h, w]
   patch grid, bilinear with align_corners=True, as 4 gathered taps a patch
   (``transformers.vision_utils.get_vision_interpolation_indices_and_weights``);
3. ``depth`` pre-LayerNorm blocks: full non-causal attention within each frame (cu_seqlens per
   frame of h*w patches) with 2-D axial rope (head_dim/4 frequencies; angles [row, col, row, col]),
   then an MLP (fc1, ``hidden_act``, fc2);
4. the merger: LayerNorm over hidden_size, each merge x merge block of patches concatenated
   (patches come block-major from the image processor), fc1, exact-erf GELU, fc2.

Attention softmaxes explicitly over blocks of query rows so that the scores held at once are
bounded (``activation_bytes``) and the result does not depend on which SDPA backend runs.
Weights load from a transformers checkpoint (``load_vision_tower``) or from llama.cpp's mmproj
GGUF (``load_mmproj``), which stores the same tensors under other names (``MMPROJ_NAMES``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.errors import ModelLoadError

_F32 = 4  # bytes
SCORE_BLOCK_BYTES = 64 << 20  # attention scores held at once, per softmax block

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:  # C*T*P*P, one row of pixel_values
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:  # the learned position table is [side, side]
        return math.isqrt(self.num_position_embeddings)

    def tokens_per_image(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.spatial_merge_size ** 2


def vision_config_from_hf(config_json: dict) -> VisionConfig | None:
    """The tower's config from a checkpoint's config.json, None without ``vision_config``."""
    v = config_json.get("vision_config")
    if not v:
        return None
    rope = v.get("rope_parameters") or {}
    try:
        return VisionConfig(
            depth=int(v["depth"]), hidden_size=int(v["hidden_size"]),
            num_heads=int(v.get("num_heads", v.get("num_attention_heads"))),
            intermediate_size=int(v["intermediate_size"]), patch_size=int(v["patch_size"]),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)), in_channels=int(v.get("in_channels", 3)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)), out_hidden_size=int(v["out_hidden_size"]),
            num_position_embeddings=int(v["num_position_embeddings"]),
            hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
            image_token_id=config_json.get("image_token_id"),
            vision_start_token_id=config_json.get("vision_start_token_id"),
            vision_end_token_id=config_json.get("vision_end_token_id"))
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"vision_config lacks a field the vision tower needs ({exc})") from exc


def expected_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower, named as in transformers without the ``model.visual.`` prefix."""
    d, i, m2 = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size ** 2
    shapes = {"patch_embed.proj.weight": (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
              "patch_embed.proj.bias": (d,), "pos_embed.weight": (cfg.num_position_embeddings, d),
              "merger.norm.weight": (d,), "merger.norm.bias": (d,),
              "merger.linear_fc1.weight": (d * m2, d * m2), "merger.linear_fc1.bias": (d * m2,),
              "merger.linear_fc2.weight": (cfg.out_hidden_size, d * m2), "merger.linear_fc2.bias": (cfg.out_hidden_size,)}
    for b in range(cfg.depth):
        for name, shape in (("norm1", (d,)), ("norm2", (d,)), ("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)),
                            ("mlp.linear_fc1", (i, d)), ("mlp.linear_fc2", (d, i))):
            shapes[f"blocks.{b}.{name}.weight"] = shape
            shapes[f"blocks.{b}.{name}.bias"] = shape[:1]
    return shapes


def _check_config(cfg: VisionConfig) -> None:
    if cfg.hidden_act not in ACTIVATIONS:
        raise ModelLoadError(f"vision hidden_act {cfg.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
        raise ModelLoadError(f"vision hidden_size {cfg.hidden_size} / {cfg.num_heads} heads is not a multiple of 4")
    if cfg.grid_side ** 2 != cfg.num_position_embeddings:
        raise ModelLoadError(f"vision num_position_embeddings {cfg.num_position_embeddings} is not a square")


def _block_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column [h*w] of each patch of one frame, in the processor's merge-block order
    (block row, block col, row in block, col in block)."""
    rows = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m).flatten()
    cols = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m).flatten()
    return rows, cols


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) taps [n, 2] into a ``side``-long axis for positions
    ``index`` [n] on a ``size``-long one, and their weights [n, 2] (transformers' arithmetic)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)  # [n]
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionTower(torch.nn.Module):
    """The tower for one config and its tensors (names of ``expected_shapes``); fp32 throughout."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor]):
        super().__init__()
        _check_config(config)
        self.config = config
        for name, shape in expected_shapes(config).items():
            t = tensors.get(name)
            if t is None:
                raise ModelLoadError(f"vision tower: tensor {name} is missing")
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"vision tower: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
            if not t.is_floating_point():
                raise ModelLoadError(f"vision tower: tensor {name} has dtype {t.dtype}, expected a float")
            self.register_buffer(self._key(name), t.to(torch.float32).contiguous(), persistent=False)

    @staticmethod
    def _key(name: str) -> str:  # buffer names cannot hold dots
        return name.replace(".", "__")

    def _w(self, name: str) -> torch.Tensor:
        return getattr(self, self._key(name))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def _query_block(self, frame_len: int) -> int:
        """Query rows softmaxed at once: scores [heads, rows, frame_len] within SCORE_BLOCK_BYTES."""
        return max(1, min(frame_len, SCORE_BLOCK_BYTES // (_F32 * self.config.num_heads * max(frame_len, 1))))

    def activation_bytes(self, num_patches: int) -> int:
        """An upper estimate of the temporaries of one forward over ``num_patches`` patches (all frames),
        every stage's counted as if alive at once: the input patches, the rope tables, the
        residual stream and ~12 more [N, D] buffers (the 4-tap position gather and its weighted copy;
        norm, qkv, roped q and k and their rotate_half, attention output and projection), the MLP's
        two [N, I] buffers, two [heads, rows, N] score blocks, and the merger output."""
        c, n = self.config, num_patches
        per_patch = c.patch_dim + 2 * c.head_dim + 13 * c.hidden_size + 2 * c.intermediate_size
        scores = 2 * c.num_heads * self._query_block(n) * n
        return _F32 * (n * per_patch + scores + -(-n // c.spatial_merge_size ** 2) * c.out_hidden_size)

    def _check_input(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> None:
        t, h, w = grid
        m = self.config.spatial_merge_size
        if h % m or w % m or min(t, h, w) < 1:
            raise ValueError(f"image grid {grid} is not made of whole {m} x {m} merge blocks")
        if tuple(pixels.shape) != (t * h * w, self.config.patch_dim):
            raise ValueError(f"pixels of shape {tuple(pixels.shape)} for grid {grid}: "
                             f"expected {(t * h * w, self.config.patch_dim)}")

    def _positions(self, grid: tuple[int, int, int]) -> torch.Tensor:  # -> [N, D]
        """The learned position table resampled to the grid, per patch in block order."""
        t, h, w = grid
        side = self.config.grid_side
        rows, cols = _block_order(h, w, self.config.spatial_merge_size)
        h_taps, h_weights = _axis_taps(rows, h, side)  # [hw, 2]
        w_taps, w_weights = _axis_taps(cols, w, side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)  # [hw, 4]
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        table = self._w("pos_embed.weight")  # [side*side, D]
        pos = (table[index.to(table.device)] * weights.to(table.device)[:, :, None]).sum(1)  # [hw, D]
        return pos.repeat(t, 1)

    def _rope(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:  # -> 2 x [N, head_dim]
        t, h, w = grid
        c = self.config
        dev = self._w("pos_embed.weight").device
        spatial = c.head_dim // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))  # [hd/4]
        rows, cols = _block_order(h, w, c.spatial_merge_size)
        fr = rows.float()[:, None] * inv_freq  # [hw, hd/4]
        fc = cols.float()[:, None] * inv_freq
        angles = torch.cat([fr, fc, fr, fc], dim=-1).repeat(t, 1).to(dev)  # [N, hd]
        return angles.cos(), angles.sin()

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention of one frame: q, k, v [heads, L, hd] -> [heads, L, hd]."""
        scale = self.config.head_dim ** -0.5
        step = self._query_block(q.shape[1])
        kt = k.transpose(1, 2)  # [heads, hd, L]
        out = [torch.softmax(torch.matmul(q[:, s:s + step], kt) * scale, dim=-1) @ v  # [heads, rows, hd]
               for s in range(0, q.shape[1], step)]
        return torch.cat(out, dim=1)

    def _attention(self, b: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   frame: int) -> torch.Tensor:  # x [N, D] -> [N, D]
        c, n = self.config, x.shape[0]
        p = f"blocks.{b}.attn."
        qkv = F.linear(x, self._w(p + "qkv.weight"), self._w(p + "qkv.bias")).view(n, 3, c.num_heads, c.head_dim)
        q, k, v = qkv.unbind(1)  # [N, heads, hd]
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = (q * cos + _rotate_half(q) * sin).transpose(0, 1)  # [heads, N, hd]
        k = (k * cos + _rotate_half(k) * sin).transpose(0, 1)
        v = v.transpose(0, 1)
        out = torch.cat([self._attend(q[:, s:s + frame], k[:, s:s + frame], v[:, s:s + frame])
                         for s in range(0, n, frame)], dim=1)  # [heads, N, hd]
        out = out.transpose(0, 1).reshape(n, c.hidden_size)
        return F.linear(out, self._w(p + "proj.weight"), self._w(p + "proj.bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self._w(name + ".weight"), self._w(name + ".bias"),
                            self.config.layer_norm_eps)

    def _block(self, b: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame: int) -> torch.Tensor:
        x = x + self._attention(b, self._norm(x, f"blocks.{b}.norm1"), cos, sin, frame)
        p = f"blocks.{b}.mlp."
        h = F.linear(self._norm(x, f"blocks.{b}.norm2"), self._w(p + "linear_fc1.weight"), self._w(p + "linear_fc1.bias"))
        h = ACTIVATIONS[self.config.hidden_act](h)  # [N, I]
        return x + F.linear(h, self._w(p + "linear_fc2.weight"), self._w(p + "linear_fc2.bias"))

    def _merge(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N / m^2, out_hidden]
        m2 = self.config.spatial_merge_size ** 2
        x = self._norm(x, "merger.norm").reshape(-1, self.config.hidden_size * m2)
        x = F.gelu(F.linear(x, self._w("merger.linear_fc1.weight"), self._w("merger.linear_fc1.bias")))
        return F.linear(x, self._w("merger.linear_fc2.weight"), self._w("merger.linear_fc2.bias"))

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image (or clip): pixels [t*h*w, C*T*P*P] as the processor lays them out -> [t*h*w / m^2, out_hidden]."""
        state = self.begin(pixels, grid)
        self.advance(state, self.config.depth)
        return self.finish(state)

    # the same forward in pieces, so an engine can spread one image's blocks over several steps
    @torch.no_grad()
    def begin(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> "Encoding":
        """The patch embedding and positions of one image: an encoding at block 0."""
        grid = tuple(int(g) for g in grid)
        self._check_input(pixels, grid)
        weight = self._w("patch_embed.proj.weight")  # [D, C, T, P, P]
        x = F.linear(pixels.to(weight.device, torch.float32), weight.view(weight.shape[0], -1),
                     self._w("patch_embed.proj.bias"))  # [N, D]
        cos, sin = self._rope(grid)
        return Encoding(x + self._positions(grid), cos, sin, grid[1] * grid[2])

    @torch.no_grad()
    def advance(self, state: "Encoding", blocks: int) -> bool:
        """Run up to ``blocks`` more blocks; True when every block has run."""
        for _ in range(min(blocks, self.config.depth - state.block)):
            state.x = self._block(state.block, state.x, state.cos, state.sin, state.frame)
            state.block += 1
        return state.block == self.config.depth

    @torch.no_grad()
    def finish(self, state: "Encoding") -> torch.Tensor:  # -> [N / m^2, out_hidden]
        self.advance(state, self.config.depth)
        return self._merge(state.x)


@dataclass
class Encoding:
    """An image part-way through the tower."""

    x: torch.Tensor  # [N, D] the residual stream after ``block`` blocks
    cos: torch.Tensor  # [N, head_dim]
    sin: torch.Tensor
    frame: int  # patches per frame (attention stays within a frame)
    block: int = 0


# ---- transformers checkpoints ----

def _read_visual_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from specserve.models.safetensors_dir import SafetensorsDir

    files = SafetensorsDir(directory)
    out: dict[str, torch.Tensor] = {}
    for key in files.keys():
        m = re.match(r"(?:model\.)?visual\.(.+)", key)
        if m:
            out[m.group(1)] = files.get(key)
    return out


def load_vision_tower(path: str | Path, device: str | torch.device = "cpu") -> VisionTower | None:
    """The tower of a transformers checkpoint directory, None when its config has no vision_config."""
    from specserve.models.weights import read_hf_config

    directory = Path(path)
    cfg = vision_config_from_hf(read_hf_config(directory))
    if cfg is None:
        return None
    tensors = {k: v.to(device) for k, v in _read_visual_tensors(directory).items()}
    return VisionTower(cfg, tensors)


# ---- llama.cpp mmproj GGUF (convert_hf_to_gguf.py --mmproj, projector type qwen3vl_merger) ----
# The converter splits the Conv3d kernel [D, C, T, P, P] into T 2-D kernels v.patch_embd.weight,
# .weight.1 (T = 2); v.post_ln is the merger's norm (before the merge-block concatenation, over
# hidden_size); mm.0 / mm.2 are the merger's fc1 / fc2; qkv keeps transformers' [q; k; v] rows.

MMPROJ_NAMES = {"v.position_embd.weight": "pos_embed.weight", "v.patch_embd.bias": "patch_embed.proj.bias",
                "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
                "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
                "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}
MMPROJ_BLOCK_NAMES = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
                      "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_PATCH_KERNELS = re.compile(r"v\.patch_embd\.weight(?:\.(\d+))?")  # one [D, C, P, P] kernel per temporal step


def _mmproj_name(name: str) -> str | None:
    if name in MMPROJ_NAMES:
        return MMPROJ_NAMES[name]
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in MMPROJ_BLOCK_NAMES:
        return f"blocks.{m.group(1)}.{MMPROJ_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _read_mmproj_tensors(reader) -> dict[str, torch.Tensor]:
    from specserve.models.weights import SUPPORTED_GGUF_TYPES, RawTensor, gguf_shape

    out: dict[str, torch.Tensor] = {}
    kernels: dict[int, torch.Tensor] = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(f"unsupported GGUF quantization type {qtype} (tensor {t.name})")
        shape = gguf_shape(t)
        patch = _PATCH_KERNELS.fullmatch(t.name)
        name = _mmproj_name(t.name)
        if patch is None and name is None:
            raise ModelLoadError(f"mmproj tensor {t.name} is not part of the Qwen3.5 vision tower we know")
        value = RawTensor(t.name, shape, qtype, t.data).dequantize()
        if patch is not None:
            kernels[int(patch.group(1) or 0)] = value
        else:
            out[name] = value
    if kernels:
        if sorted(kernels) != list(range(len(kernels))):
            raise ModelLoadError(f"mmproj patch kernels v.patch_embd.weight[.k] are incomplete: {sorted(kernels)}")
        out["patch_embed.proj.weight"] = torch.stack([kernels[i] for i in range(len(kernels))], dim=2)  # [D, C, T, P, P]
    return out


def _meta_int(meta: dict, key: str, default: int | None = None) -> int:
    if meta.get(key, default) is None:
        raise ModelLoadError(f"mmproj metadata lacks {key}")
    return int(meta.get(key, default))


def _mmproj_act(meta: dict) -> str:
    """llama.cpp's choice: use_gelu -> its tanh GELU, use_silu -> SiLU, neither -> quick GELU."""
    if meta.get("clip.use_gelu"):
        return "gelu_pytorch_tanh"
    return "silu" if meta.get("clip.use_silu") else "quick_gelu"


def mmproj_config(meta: dict, tensors: dict[str, torch.Tensor], image_token_id: int | None = None,
                  vision_start_token_id: int | None = None, vision_end_token_id: int | None = None) -> VisionConfig:
    """The tower's config from mmproj metadata (``clip.vision.*``) and the shapes the file holds:
    the temporal patch size is the number of 2-D patch kernels, the position table's rows its
    count, the merger's output its width; rope theta is llama.cpp's fixed 10000 and the
    LayerNorm eps transformers' fixed 1e-6 (the file's is the text model's rms_norm_eps)."""
    projector = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if projector != "qwen3vl_merger":
        raise ModelLoadError(f"mmproj projector type {projector!r} is not supported (expected 'qwen3vl_merger')")
    if any(meta.get("clip.vision.is_deepstack_layers") or []):
        raise ModelLoadError("mmproj has deepstack layers (Qwen3-VL); only the Qwen3.5 tower is supported")
    for name in ("patch_embed.proj.weight", "pos_embed.weight", "merger.linear_fc2.weight"):
        if name not in tensors:
            raise ModelLoadError(f"vision tower: tensor {name} is missing")
    patch = tensors["patch_embed.proj.weight"]  # [D, C, T, P, P]
    return VisionConfig(
        depth=_meta_int(meta, "clip.vision.block_count"), hidden_size=_meta_int(meta, "clip.vision.embedding_length"),
        num_heads=_meta_int(meta, "clip.vision.attention.head_count"),
        intermediate_size=_meta_int(meta, "clip.vision.feed_forward_length"),
        patch_size=_meta_int(meta, "clip.vision.patch_size"), temporal_patch_size=patch.shape[2],
        in_channels=patch.shape[1], spatial_merge_size=_meta_int(meta, "clip.vision.spatial_merge_size", 2),
        out_hidden_size=tensors["merger.linear_fc2.weight"].shape[0],
        num_position_embeddings=tensors["pos_embed.weight"].shape[0],
        hidden_act=_mmproj_act(meta),
        image_token_id=image_token_id, vision_start_token_id=vision_start_token_id,
        vision_end_token_id=vision_end_token_id)


def load_mmproj(path: str | Path, device: str | torch.device = "cpu", image_token_id: int | None = None,
                vision_start_token_id: int | None = None, vision_end_token_id: int | None = None) -> VisionTower:
    """The tower from a llama.cpp mmproj GGUF; the token ids live in the text GGUF, so the caller passes them."""
    from specserve.models.weights import gguf_metadata, open_gguf

    reader = open_gguf(Path(path))
    tensors = _read_mmproj_tensors(reader)
    cfg = mmproj_config(gguf_metadata(reader), tensors, image_token_id, vision_start_token_id, vision_end_token_id)
    return VisionTower(cfg, {k: v.to(device) for k, v in tensors.items()})
