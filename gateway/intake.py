"""Image intake: every image is judged and shrunk here, before any model time.

data: URL → bytes → decode → EXIF transpose → RGB → downscale to the encoder's
pixel budget → uint8 (h, w, 3) array, plus a digest of the original bytes and
the intake policy (the encoder adds its model identity to form the cache key).
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from cache import content_key
from gateway.errors import APIError
from gateway.resize import smart_resize
from protocol.to_gateway import ProcessorInfo

INTAKE_VERSION = "intake-v1"
BACKGROUND = (255, 255, 255)  # what transparent pixels become
RESAMPLE = Image.Resampling.BICUBIC


@dataclass(frozen=True)
class IntakePolicy:
    """Everything the gateway does to pixels; all of it is in the cache key."""

    processor: ProcessorInfo

    @property
    def factor(self) -> int:
        return self.processor.patch_size * self.processor.merge_size

    def as_key_part(self) -> dict:
        return {
            "version": INTAKE_VERSION,
            "min_pixels": self.processor.min_pixels,
            "max_pixels": self.processor.max_pixels,
            "factor": self.factor,
            "resample": "bicubic",
            "background": list(BACKGROUND),
            "exif_transpose": True,
        }


@dataclass(frozen=True)
class PreparedImage:
    digest: bytes
    pixels: np.ndarray  # uint8 (h, w, 3), C-contiguous
    original_size: tuple[int, int]  # (width, height) after EXIF transpose
    fetch_s: float
    preprocess_s: float


def decode_data_url(url: str, where: str) -> bytes:
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "(none)"
        raise APIError(400, f"{where}: only data: URLs are supported (got scheme {scheme!r})", param=where, code="unsupported_image_url")
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise APIError(400, f"{where}: malformed data: URL (no comma)", param=where, code="invalid_image_url")
    if not header.endswith(";base64"):
        raise APIError(400, f"{where}: data: URL must be base64-encoded", param=where, code="invalid_image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: data: URL is not valid base64", param=where, code="invalid_image_url") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, BACKGROUND)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image.convert("RGB")


def _downscale(image: Image.Image, policy: IntakePolicy) -> Image.Image:
    width, height = image.size
    p = policy.processor
    # Always computed: it refuses aspect ratios the model cannot take.
    target_h, target_w = smart_resize(height, width, policy.factor, p.min_pixels, p.max_pixels)
    if width * height <= p.max_pixels:
        return image  # within budget: the encoder's processor does the final rounding itself
    return image.resize((target_w, target_h), RESAMPLE)


def prepare_image(raw: bytes, policy: IntakePolicy, where: str, fetch_s: float = 0.0) -> PreparedImage:
    """Decode and normalise one image (CPU-bound: run it off the event loop)."""
    started = time.perf_counter()
    digest = content_key(policy.as_key_part(), raw)
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            image = ImageOps.exif_transpose(opened)
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise APIError(400, f"{where}: cannot decode image ({exc})", param=where, code="invalid_image") from None
    original_size = image.size
    try:
        image = _downscale(_to_rgb(image), policy)
    except ValueError as exc:  # aspect ratio beyond the model's limit
        raise APIError(400, f"{where}: {exc}", param=where, code="invalid_image") from None
    pixels = np.asarray(image, dtype=np.uint8)
    return PreparedImage(digest, np.ascontiguousarray(pixels), original_size, fetch_s, time.perf_counter() - started)


def fetch_and_prepare(url: str, policy: IntakePolicy, where: str) -> PreparedImage:
    started = time.perf_counter()
    raw = decode_data_url(url, where)
    return prepare_image(raw, policy, where, time.perf_counter() - started)
