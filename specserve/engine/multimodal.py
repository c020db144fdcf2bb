"""Images inside a prompt: where their placeholder tokens sit, their M-RoPE positions, the
keys the prefix cache hashes for them, and a per-image cache of encoder outputs.

A prompt with images is its token ids (each image a run of ``<|image_pad|>`` tokens between
``<|vision_start|>`` and ``<|vision_end|>``) plus one :class:`ImageInput` per run. Positions
follow transformers' ``get_rope_index`` for Qwen3.5 / Qwen3-VL: a text token's (t, h, w) are
all ``text position``; an image's tokens get (start, start + row, start + column) on the merged
grid, and the text after it continues at ``start + max(rows, columns)``. A token past the
prompt (generated, or a draft) sits at ``index + delta`` on all three axes.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, preprocessed."""

    key: int  # content hash of the preprocessed pixels and grid (63 bits)
    pixels: torch.Tensor = field(repr=False)  # [N, C * T * P * P] float32 patches
    grid: tuple[int, int, int]  # (t, h, w) patches
    merge: int  # spatial merge: each placeholder token stands for merge x merge patches
    offset: int = -1  # index of its first placeholder token in the prompt

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // (self.merge * self.merge)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def placed(self, offset: int) -> "ImageInput":
        return ImageInput(self.key, self.pixels, self.grid, self.merge, offset)


def image_key(pixels: torch.Tensor, grid: tuple[int, int, int]) -> int:
    """A stable 63-bit content key (the same picture twice is the same key, any process)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(tuple(grid)).encode())
    h.update(pixels.contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass
class MultiModalPrompt:
    """The images of one prompt, placed, and the M-RoPE positions of the whole prompt."""

    images: list[ImageInput]
    positions: torch.Tensor  # [L, 3] int32, (t, h, w) of each prompt token
    delta: int  # rotary position minus token index for every token after the prompt
    _keys: list[int] | None = field(default=None, repr=False)  # cache_keys, built once

    @staticmethod
    def build(prompt_ids: list[int], images: list[ImageInput], image_token_id: int) -> "MultiModalPrompt":
        """Place ``images`` at the runs of ``image_token_id`` in prompt order; each run must be
        exactly as long as its image's token count (ValueError otherwise)."""
        runs = _runs(prompt_ids, image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholder runs for {len(images)} images")
        placed, pos, at, cur = [], [], 0, 0
        for (start, length), img in zip(runs, images):
            if length != img.num_tokens:
                raise ValueError(f"an image of {img.num_tokens} tokens has a placeholder run of {length}")
            pos.append(text_positions(cur, start - at))
            cur += start - at
            t, h, w = img.grid[0], img.grid[1] // img.merge, img.grid[2] // img.merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            pos.append(torch.stack([tt, hh, ww], dim=-1).reshape(-1, 3) + cur)  # [t*h*w, 3]
            cur += max(h, w)
            at = start + length
            placed.append(img.placed(start))
        pos.append(text_positions(cur, len(prompt_ids) - at))
        cur += len(prompt_ids) - at
        return MultiModalPrompt(placed, torch.cat(pos).to(torch.int32), cur - len(prompt_ids))

    def rope_rows(self, start: int, count: int) -> torch.Tensor:
        """[count, 3] int32 positions of tokens start .. start + count - 1."""
        n = self.positions.shape[0]
        head = self.positions[start:min(start + count, n)]
        tail_from = max(start, n)
        tail = text_positions(tail_from + self.delta, max(start + count - tail_from, 0))
        return torch.cat([head, tail.to(torch.int32)])

    def cache_keys(self, prompt_ids: list[int]) -> list[int]:
        """The prompt as the prefix cache hashes it: an image's placeholder tokens replaced by a
        negative key of its content, so the same image is a hit and another image is not."""
        if self._keys is None or len(self._keys) != len(prompt_ids):
            keys = list(prompt_ids)
            for img in self.images:
                keys[img.offset:img.end] = [-1 - img.key] * img.num_tokens
            self._keys = keys
        return self._keys

    def overlapping(self, start: int, count: int) -> list[tuple[ImageInput, int, int]]:
        """(image, first, last + 1) token indices of each image inside start .. start + count - 1."""
        out = []
        for img in self.images:
            a, b = max(start, img.offset), min(start + count, img.end)
            if a < b:
                out.append((img, a, b))
        return out


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def text_positions(first: int, count: int) -> torch.Tensor:  # -> [count, 3]
    """Text tokens first .. first + count - 1: the same position on the three axes."""
    return torch.arange(first, first + count, dtype=torch.int64).unsqueeze(1).expand(count, 3)


def vision_memory(target, encoder_cache_bytes: int) -> tuple[int, int, int]:
    """(tower weights, one forward's activations at the largest image the preprocessing lets
    through, the encoder-output cache) in bytes; zeros for a text-only model. Counted up front:
    the activations appear only with the first image."""
    vision, processor = target.vision, target.image_processor
    if vision is None or processor is None:
        return 0, 0, 0
    max_patches = max(processor.max_pixels // vision.config.patch_size ** 2, 1)
    return vision.nbytes, vision.activation_bytes(max_patches), encoder_cache_bytes


class EncoderCache:
    """Vision-encoder outputs by image key, least recently used dropped past ``max_bytes``.

    An image's embeddings are computed once (chunked prefill of a long image, a second request
    with the same picture and every drafter read the same tensor), so they are the same bits in
    every step that uses them. ``tower`` (models/vision.VisionTower) runs an image whole, or a few
    blocks at a time (``work``): the engine spreads an image over several steps while streams
    decode, so none of them waits for a whole image."""

    def __init__(self, tower, max_bytes: int = 512 << 20):
        self.tower, self.max_bytes = tower, max_bytes
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.pending: dict[int, object] = {}  # key -> an encoding part-way through the tower
        self.bytes, self.hits, self.misses = 0, 0, 0
        self.most_blocks_per_call = 0  # (for tests: the largest slice one ``work`` call ran)

    def ready(self, key: int) -> bool:
        return key in self.entries

    def unencoded(self, seq) -> list[ImageInput]:
        """seq's images still to prefill whose encoder output is not ready."""
        return [img for img in seq.mm.images if img.end > seq.num_computed and not self.ready(img.key)] \
            if seq.mm is not None else []

    def computable(self, seq) -> int:
        """How far seq's prompt can be computed: up to its first image not encoded yet (the
        scheduler's ``computable`` hook; a method of this cache, not of the engine, so the engine
        holds no reference cycle that would keep its weights alive until a full gc pass)."""
        return min((img.offset for img in self.unencoded(seq)), default=seq.num_tokens)

    def get(self, img: ImageInput) -> torch.Tensor:  # -> [num_tokens, H]
        out = self.entries.get(img.key)
        if out is not None:
            self.entries.move_to_end(img.key)
            self.hits += 1
            return out
        self.misses += 1
        state = self.pending.pop(img.key, None) or self.tower.begin(img.pixels, img.grid)
        return self._store(img, self.tower.finish(state))

    def work(self, images: list[ImageInput], deadline: float | None) -> None:
        """Encode ``images`` ahead of the steps that need them: all of them (deadline None), or
        block by block until ``deadline`` (time.perf_counter), at least one block per call."""
        blocks = 0
        for img in images:
            while not self.ready(img.key):
                state = self.pending.get(img.key)
                if state is None:
                    state = self.pending[img.key] = self.tower.begin(img.pixels, img.grid)
                done = self.tower.advance(state, 1)
                blocks += 1
                if done:
                    self.misses += 1
                    self._store(img, self.tower.finish(self.pending.pop(img.key)))
                if deadline is not None and time.perf_counter() >= deadline:
                    self.most_blocks_per_call = max(self.most_blocks_per_call, blocks)
                    return
        self.most_blocks_per_call = max(self.most_blocks_per_call, blocks)

    def _store(self, img: ImageInput, out: torch.Tensor) -> torch.Tensor:
        out = out.to(torch.float32)
        if out.shape[0] != img.num_tokens:
            raise RuntimeError(f"the vision encoder gave {out.shape[0]} rows for an image of {img.num_tokens} tokens")
        self.entries[img.key] = out
        self.bytes += out.numel() * out.element_size()
        while self.bytes > self.max_bytes and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        return out
