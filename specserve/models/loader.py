"""Turn a ``--model`` value into a ready :class:`Transformer` plus its tokenizer."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import ModelLoadError
from specserve.kernels.hostmem import gather_small
from specserve.models import config as mconfig
from specserve.models import tokenizer as mtok
from specserve.models import weights as mweights
from specserve.models.image_processor import ImageProcessor
from specserve.models.layers import linears
from specserve.models.vision import VisionTower
from specserve.models.catalog import ResolvedModel, cache_root, resolve_model
from specserve.models.families import family
from specserve.models.hybrid import HybridTransformer
from specserve.models.transformer import Transformer
from specserve.parallel.shard import Shard, shard_tensors

log = logging.getLogger("specserve.models")


@dataclass(frozen=True)
class LoadOptions:
    """How to run the weights: device, activation dtype and weight format."""

    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "auto"  # one of specserve.models.quant.QUANTIZATIONS
    mmproj: str | None = None  # a llama.cpp mmproj GGUF: the vision tower of a GGUF model
    shard: Shard = Shard(0, 1)  # tensor parallel: the part of the weights this rank keeps
    vision: bool = True  # False: skip a vision tower (a tensor-parallel worker: rank 0 encodes images)

    def torch_device(self) -> torch.device:
        """The device; on CUDA a tensor-parallel rank takes GPU ``rank % GPUs`` (one GPU per rank
        where there are as many as ranks per machine; ranks share them where there are fewer)."""
        if self.device == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("--device cuda was asked for but torch sees no CUDA device")
        else:
            kind = self.device
        if kind == "cuda" and self.shard.active:
            return torch.device("cuda", self.shard.rank % torch.cuda.device_count())
        return torch.device(kind)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        if device.type == "cpu" and self.dtype != "float32":
            raise ModelLoadError(f"--dtype {self.dtype} is not supported on CPU: our batch-invariant CPU kernels "
                                 "compute in float32 (use --quantization int8|q4 to shrink the weights)")
        return getattr(torch, self.dtype)

    def weight_format(self, device: torch.device) -> str:
        if self.quantization == "auto":
            return "q4" if device.type == "cpu" else "none"
        return self.quantization


@dataclass
class LoadedModel:
    name: str
    resolved: ResolvedModel
    config: mconfig.ModelConfig
    model: Transformer
    tokenizer: mtok.Tokenizer
    identity: str  # stable id of the weights (for prefix-cache keys and vocab checks)
    vision: "VisionTower | None" = None  # the image encoder (models/vision.py); None: text only
    image_processor: "ImageProcessor | None" = None  # images -> patches for ``vision``


IDENTITY_SAMPLE = 1 << 20  # bytes hashed at each end of a weight file


def _identity(resolved: ResolvedModel) -> str:
    """Stable id of the weights from their content (name, size, first and last MiB), not their
    mtime: a copied or re-assembled file keeps its tokenizer cache and prefix-cache keys."""
    h = hashlib.sha256()
    for f in resolved.files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(IDENTITY_SAMPLE))
            if size > IDENTITY_SAMPLE:
                fh.seek(max(size - IDENTITY_SAMPLE, IDENTITY_SAMPLE))
                h.update(fh.read(IDENTITY_SAMPLE))
    return h.hexdigest()[:16]


def load_tokenizer(spec: str) -> mtok.Tokenizer:
    """A model's tokenizer without its weights (the same cache as load_model's)."""
    resolved = resolve_model(spec)
    if resolved.kind == "gguf":
        return _gguf_tokenizer(resolved.path, _identity(resolved))
    return mtok.from_hf_dir(resolved.path)


def _gguf_tokenizer(path: Path, identity: str) -> mtok.Tokenizer:
    return mtok.from_gguf(path, cache_root() / "tokenizers" / identity)  # converted once, cached per weights


def load_model(spec: str, options: LoadOptions = LoadOptions()) -> LoadedModel:
    resolved = resolve_model(spec)
    device = options.torch_device()
    dtype = options.torch_dtype(device)
    quant = options.weight_format(device)
    identity = _identity(resolved)
    if resolved.kind == "gguf":
        cfg, tensors, tok, offset = _read_gguf(resolved.path, identity)
    else:
        cfg, tensors, tok, offset = _read_hf(resolved.path)
    model_class = HybridTransformer if cfg.hybrid else Transformer
    rank_cfg = cfg
    if options.shard.active:
        rank_cfg, tensors = shard_tensors(cfg, tensors, options.shard)
    model = model_class(rank_cfg, tensors, quant, device, dtype, norm_offset=offset,
                        norm_offset_skip=family(cfg.arch).hf_norm_offset_skip if offset else ())
    model.shard = options.shard if options.shard.active else None
    if device.type == "cpu":  # the small matrices in one run of huge pages, like the large ones
        gather_small([lin.weight for lin in linears(model)])
    log.info("loaded %s (%s, %d layers) on %s, weights %s, %.0f MB%s", resolved.name, cfg.arch, cfg.num_layers,
             device, quant, model.weight_bytes() / 1e6,
             f" (rank {options.shard.rank} of {options.shard.world})" if options.shard.active else "")
    vision, processor = _load_vision(resolved, cfg, options, device, tok) if options.vision else (None, None)
    return LoadedModel(resolved.name, resolved, cfg, model, tok, identity, vision, processor)


def _load_vision(resolved: ResolvedModel, cfg: mconfig.ModelConfig, options: LoadOptions, device: torch.device,
                 tok: mtok.Tokenizer):
    """The image encoder and its preprocessing: from the checkpoint (model.visual.*) or --mmproj."""
    from specserve.models.vision import load_mmproj, load_vision_tower

    if options.mmproj:
        if resolved.kind != "gguf":
            raise ModelLoadError("--mmproj takes the vision tower of a GGUF model; this checkpoint carries its own")
        if not Path(options.mmproj).is_file():  # named before the model's vocabulary is asked about
            raise ModelLoadError(f"--mmproj {options.mmproj}: no such file")
        vision = load_mmproj(options.mmproj, device, **vision_token_ids(tok))
        processor = ImageProcessor.from_mmproj(options.mmproj)
    elif resolved.kind != "gguf":
        vision = load_vision_tower(resolved.path, device)
        processor = ImageProcessor(resolved.path) if vision is not None else None
    else:
        return None, None
    if vision is not None and not cfg.mrope_section:
        raise ModelLoadError(f"{resolved.name}: a vision tower needs M-RoPE positions (rope mrope_section), "
                             "the text model has none")
    if vision is not None and vision.config.out_hidden_size != cfg.hidden_size:
        raise ModelLoadError(f"the vision tower's output ({vision.config.out_hidden_size}) does not match the model's "
                             f"hidden size ({cfg.hidden_size})")
    return vision, processor


VISION_TOKENS = {"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
                 "vision_end_token_id": "<|vision_end|>"}


def vision_token_ids(tok: mtok.Tokenizer) -> dict[str, int]:
    """The image placeholder tokens of a GGUF model's vocabulary (an mmproj file does not name them)."""
    ids = {k: tok.backend.token_to_id(v) for k, v in VISION_TOKENS.items()}
    missing = [VISION_TOKENS[k] for k, v in ids.items() if v is None]
    if missing:
        raise ModelLoadError(f"--mmproj: the model's vocabulary has no {', '.join(missing)} token")
    return ids


def _read_gguf(path: Path, identity: str):
    reader = mweights.open_gguf(path)
    meta = mweights.gguf_metadata(reader)
    arch = family(meta.get("general.architecture"), path.name).arch
    mweights.check_tensor_types(reader)
    vocab = _gguf_vocab_size(reader, meta)
    cfg = mconfig.from_gguf_metadata(meta, vocab)
    tensors = _rewrite(cfg, mweights.read_gguf_tensors(reader, arch, cfg.num_heads, cfg.num_kv_heads))
    _check_shapes(cfg, tensors, path)
    tok = _gguf_tokenizer(path, identity)
    return cfg, tensors, tok, 0.0  # llama.cpp's converter already folded Gemma's +1 into the norms


def _gguf_vocab_size(reader, meta: dict) -> int:
    if f"{meta.get('general.architecture')}.vocab_size" in meta:
        return int(meta[f"{meta['general.architecture']}.vocab_size"])
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise ModelLoadError("GGUF has no vocabulary (tokenizer.ggml.tokens)")
    return len(field.data)


def _read_hf(directory: Path):
    raw_cfg = mweights.read_hf_config(directory)
    cfg = mconfig.from_hf_config(raw_cfg)
    tensors = _rewrite(cfg, mweights.read_safetensors(directory, cfg.arch))
    _check_shapes(cfg, tensors, directory)
    tok = mtok.from_hf_dir(directory)
    return cfg, tensors, tok, family(cfg.arch).hf_norm_offset


def _rewrite(cfg: mconfig.ModelConfig, tensors: dict) -> dict:
    rewrite = family(cfg.arch).rewrite
    return tensors if rewrite is None else rewrite(tensors, cfg)


def _check_shapes(cfg: mconfig.ModelConfig, tensors: dict, where: Path) -> None:
    want = {"embed": (cfg.vocab_size, cfg.hidden_size), "layers.0.q": (cfg.q_size, cfg.hidden_size),
            "layers.0.k": (cfg.kv_size, cfg.hidden_size), "layers.0.down": (cfg.hidden_size, cfg.intermediate_size)}
    for name, shape in want.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                                 f"config says {shape}")
