"""Images in chat requests: ``image_url`` content parts -> decoded, preprocessed images and the
prompt's token ids with each image's placeholder run.

A part is ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (or the
url as a plain string). ``data:`` URLs are always read; ``http(s)`` URLs only from the hosts
the operator allows (``--allowed-media-domains``, as vLLM), with a size and a time limit. PNG,
JPEG and WebP, through Pillow. The rendered prompt carries one private-use mark per image where
the part sat; the mark becomes ``<|vision_start|>`` + placeholders + ``<|vision_end|>``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from specserve.engine.multimodal import ImageInput, image_key
from specserve.errors import RequestError, SpecserveError

IMAGE_PART_TYPES = ("image_url", "input_image")
IMAGE_MARK = "\ue001"  # where an image part sat in the rendered prompt (a private-use character)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


@dataclass(frozen=True)
class MediaConfig:
    """What images a request may bring."""

    allowed_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may come from; empty: none
    max_images: int = 8  # --limit-mm-per-prompt '{"image": N}'
    max_image_bytes: int = 20 << 20  # an encoded image (a data URL's payload or a download)
    fetch_timeout: float = 10.0  # seconds a download may take
    max_image_pixels: int = 64 << 20  # a decoded image (guards against decompression bombs)

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise SpecserveError(f"--limit-mm-per-prompt: the image limit must be >= 0, got {self.max_images}")
        if not self.fetch_timeout > 0:
            raise SpecserveError(f"--media-fetch-timeout must be > 0 seconds, got {self.fetch_timeout}")
        if self.max_image_bytes < 1:
            raise SpecserveError(f"--max-image-bytes must be >= 1, got {self.max_image_bytes}")
        if self.max_image_pixels < 1:
            raise SpecserveError(f"--max-image-pixels must be >= 1, got {self.max_image_pixels}")
        object.__setattr__(self, "allowed_domains", tuple(d.strip().lower() for d in self.allowed_domains if d.strip()))


def parse_limit_mm(value: str | None) -> int:
    """vLLM's --limit-mm-per-prompt: JSON ``{"image": 4}`` or ``image=4``; None: the default."""
    if value is None:
        return MediaConfig.max_images
    try:
        limits = json.loads(value) if value.strip().startswith("{") else dict(
            kv.split("=", 1) for kv in value.split(",") if kv.strip())
        unknown = sorted(set(limits) - {"image"})
        if unknown:
            raise SpecserveError(f"--limit-mm-per-prompt: modality {unknown[0]!r} is not supported (image only)")
        return int(limits.get("image", MediaConfig.max_images))
    except (ValueError, TypeError) as exc:
        raise SpecserveError(f"--limit-mm-per-prompt must be JSON like '{{\"image\": 4}}', got {value!r}") from exc


def image_url_of(part, where: str) -> str:
    """The URL of an image content part (OpenAI's object form, or the url as a string)."""
    field = (part.model_extra or {}).get("image_url")  # (a ContentPart: image_url is an extra field)
    url = field.get("url") if isinstance(field, dict) else field
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where} ({IMAGE_PART_TYPES[0]}) has no image_url.url", param=where)
    return url


class MediaLoader:
    """Downloads or decodes the images of a request and preprocesses them for the model."""

    def __init__(self, cfg: MediaConfig, processor, merge: int):
        self.cfg, self.processor, self.merge = cfg, processor, merge

    def check_count(self, n: int) -> None:
        if self.processor is None and n:
            raise RequestError("this model does not read images (no vision tower; a GGUF model takes one with "
                               "--mmproj FILE)", param="messages", code="images_not_supported")
        if n > self.cfg.max_images:
            raise RequestError(f"the request has {n} images; at most {self.cfg.max_images} per prompt "
                               "(--limit-mm-per-prompt)", param="messages", code="too_many_images")

    async def load(self, urls: list[tuple[str, str]]) -> list[ImageInput]:
        """urls: (url, where in the request) in prompt order -> preprocessed images."""
        self.check_count(len(urls))
        if not urls:
            return []
        datas = await asyncio.gather(*(self.read(url, where) for url, where in urls))
        return await asyncio.to_thread(self.preprocess, [(d, where) for d, (_, where) in zip(datas, urls)])

    async def read(self, url: str, where: str) -> bytes:
        if url.startswith("data:"):
            return self._data_url(url, where)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise RequestError(f"{where}: image URLs must be data: or http(s) URLs", param=where,
                               code="invalid_image_url")
        host = (parts.hostname or "").lower()
        if host not in self.cfg.allowed_domains:
            raise RequestError(f"{where}: image URLs from {host!r} are not allowed (the server reads data: URLs; "
                               "an operator allows hosts with --allowed-media-domains)", param=where,
                               code="image_domain_not_allowed")
        return await self._download(url, where)

    def _data_url(self, url: str, where: str) -> bytes:
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise RequestError(f"{where}: a data URL must be data:image/...;base64,<data>", param=where,
                               code="invalid_image_url")
        if len(payload) * 3 // 4 > self.cfg.max_image_bytes:
            raise RequestError(f"{where}: the image is larger than {self.cfg.max_image_bytes} bytes", param=where,
                               code="image_too_large")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RequestError(f"{where}: the data URL is not valid base64", param=where,
                               code="invalid_image_url") from exc

    async def _download(self, url: str, where: str) -> bytes:
        limit = self.cfg.max_image_bytes
        try:
            async with httpx.AsyncClient(timeout=self.cfg.fetch_timeout, follow_redirects=False) as client:
                async with asyncio.timeout(self.cfg.fetch_timeout), client.stream("GET", url) as resp:
                    if resp.status_code != 200:
                        raise RequestError(f"{where}: fetching the image gave HTTP {resp.status_code}", param=where,
                                           code="image_fetch_failed")
                    body = bytearray()
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > limit:
                            raise RequestError(f"{where}: the image is larger than {limit} bytes", param=where,
                                               code="image_too_large")
                    return bytes(body)
        except (httpx.HTTPError, TimeoutError) as exc:
            raise RequestError(f"{where}: fetching the image failed ({type(exc).__name__})", param=where,
                               code="image_fetch_failed") from exc

    def preprocess(self, datas: list[tuple[bytes, str]]) -> list[ImageInput]:
        """(encoded image, where it came from) -> preprocessed images (RequestError naming a bad one)."""
        out = []
        for data, where in datas:
            try:
                pixels, grid = self.processor(self.decode(data, where))
            except ValueError as exc:  # e.g. an aspect ratio beyond what the model's resizing allows
                raise RequestError(f"{where}: {exc}", param=where, code="invalid_image") from exc
            out.append(ImageInput(image_key(pixels, grid), pixels, tuple(grid), self.merge))
        return out

    def decode(self, data: bytes, where: str):
        from PIL import Image

        try:
            img = Image.open(io.BytesIO(data))
            if img.format not in IMAGE_FORMATS:
                raise RequestError(f"{where}: image format {img.format} is not supported (PNG, JPEG, WebP)",
                                   param=where, code="invalid_image")
            if img.width * img.height > self.cfg.max_image_pixels:
                raise RequestError(f"{where}: the image has {img.width}x{img.height} pixels, more than "
                                   f"{self.cfg.max_image_pixels}", param=where, code="image_too_large")
            img.load()
            return img
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a broken file
            raise RequestError(f"{where}: the image cannot be decoded ({type(exc).__name__})", param=where,
                               code="invalid_image") from exc


def expand_images(tokenizer, prompt: str, images: list[ImageInput], vision_cfg) -> list[int]:
    """The token ids of a rendered prompt whose image marks become vision_start, one placeholder
    per image token, vision_end (text between marks tokenized on its own; the specials split
    the text the same way when the whole prompt is tokenized)."""
    pieces = prompt.split(IMAGE_MARK)
    if len(pieces) - 1 != len(images):
        raise RequestError(f"the chat template wrote {len(pieces) - 1} of the request's {len(images)} images "
                           "(an image part must sit in a message's content)", param="messages")
    ids = tokenizer.encode(pieces[0], add_special_tokens=False)
    for img, text in zip(images, pieces[1:]):
        ids += [vision_cfg.vision_start_token_id, *[vision_cfg.image_token_id] * img.num_tokens,
                vision_cfg.vision_end_token_id]
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids
