"""Image preprocessing for the Qwen3.5 vision tower: transformers' own Qwen2VLImageProcessorPil.

Resizing (``smart_resize`` to whole merge blocks within [min_pixels, max_pixels], bicubic),
rescaling, normalising and the patch layout are transformers' code, so the pixels are its bits.
We only make the input one RGB PIL image (transparency composited onto white, as transformers'
``convert_to_rgb`` does) and hand back a torch tensor and the grid of that one image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from specserve.errors import ModelLoadError

# llama.cpp's limits for Qwen-VL projectors (clip.cpp: set_limit_image_tokens(8, 4096)), in merged tokens
LLAMA_CPP_MIN_TOKENS, LLAMA_CPP_MAX_TOKENS = 8, 4096


class ImageProcessor:
    """One image -> (pixels [t*h*w, C*T*P*P] float32, grid (t, h, w)).

    ``directory`` with a preprocessor_config.json builds transformers' processor from it; otherwise
    the explicit parameters do. Given with a directory, ``min_pixels``/``max_pixels`` (an operator's
    cap) replace the configured bounds of the resized area; the smallest is lowered to the largest
    when above it.
    """

    def __init__(self, directory: str | Path | None = None, *, patch_size: int | None = None,
                 temporal_patch_size: int = 2, merge_size: int = 2,
                 image_mean: Sequence[float] = (0.5, 0.5, 0.5), image_std: Sequence[float] = (0.5, 0.5, 0.5),
                 min_pixels: int | None = None, max_pixels: int | None = None):
        from transformers import AutoImageProcessor, Qwen2VLImageProcessorPil

        if directory is not None and (Path(directory) / "preprocessor_config.json").exists():
            self._hf = AutoImageProcessor.from_pretrained(str(directory), backend="pil")
            if not isinstance(self._hf, Qwen2VLImageProcessorPil):
                raise ModelLoadError(f"{directory}: image processor {type(self._hf).__name__} is not Qwen2-VL's")
        elif patch_size is None or min_pixels is None or max_pixels is None:
            raise ModelLoadError("no preprocessor_config.json: the image processor needs patch_size, min_pixels "
                                 "and max_pixels" + (f" ({directory})" if directory is not None else ""))
        else:
            self._hf = Qwen2VLImageProcessorPil(
                patch_size=int(patch_size), temporal_patch_size=int(temporal_patch_size), merge_size=int(merge_size),
                image_mean=[float(x) for x in image_mean], image_std=[float(x) for x in image_std],
                min_pixels=int(min_pixels), max_pixels=int(max_pixels))
        self.max_pixels = int(max_pixels if max_pixels is not None else self._hf.size["longest_edge"])
        self.min_pixels = min(int(min_pixels if min_pixels is not None else self._hf.size["shortest_edge"]),
                              self.max_pixels)

    @classmethod
    def from_mmproj(cls, path: str | Path, max_pixels: int | None = None) -> ImageProcessor:
        """From a llama.cpp mmproj's ``clip.vision.*`` metadata (patch size, merge size, mean, std);
        the area limits are llama.cpp's for Qwen-VL (8 to 4096 merged tokens) unless the file has its own."""
        from specserve.models.weights import gguf_metadata, open_gguf

        reader = open_gguf(Path(path))
        meta = gguf_metadata(reader)
        temporal = sum(t.name.startswith("v.patch_embd.weight") for t in reader.tensors) or 2  # a 2-D kernel a step
        try:
            patch, merge = int(meta["clip.vision.patch_size"]), int(meta.get("clip.vision.spatial_merge_size", 2))
            mean, std = list(meta["clip.vision.image_mean"]), list(meta["clip.vision.image_std"])
        except KeyError as exc:
            raise ModelLoadError(f"{path}: mmproj metadata lacks {exc.args[0]}") from exc
        block = (patch * merge) ** 2
        return cls(patch_size=patch, temporal_patch_size=temporal, merge_size=merge, image_mean=mean, image_std=std,
                   min_pixels=int(meta.get("clip.vision.image_min_pixels", LLAMA_CPP_MIN_TOKENS * block)),
                   max_pixels=max_pixels or int(meta.get("clip.vision.image_max_pixels", LLAMA_CPP_MAX_TOKENS * block)))

    @property
    def merge_size(self) -> int:
        return int(self._hf.merge_size)

    @property
    def hf_processor(self):
        """transformers' processor (its own size bounds, not an override of ours)."""
        return self._hf

    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One PIL image -> (pixels [t*h*w, C*T*P*P] float32, (t, h, w))."""
        from PIL import Image
        from transformers.image_transforms import convert_to_rgb

        if not isinstance(image, Image.Image):
            raise TypeError(f"expected a PIL image, got {type(image).__name__}")
        if image.mode != "RGB":
            image = Image.fromarray(convert_to_rgb(image, return_numpy=True))
        size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        out = self._hf(image, size=size, return_tensors="pt")
        grid = tuple(int(g) for g in out["image_grid_thw"][0].tolist())
        return out["pixel_values"].to(torch.float32), grid

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens the tower makes for this grid (patches / merge^2)."""
        t, h, w = grid
        return t * h * w // self.merge_size ** 2
