"""Synthetic, photo-like test images (smooth gradient, a few discs, mild noise).

Used by the load tester (workload.py), the tests and the benchmarks:
deterministic per name, one picture per name, and not white noise, so
resizing and JPEG behave as they do on real pictures.
"""

from __future__ import annotations

import base64
import hashlib
import io

import numpy as np
from PIL import Image, ImageDraw


def make_image(name: str, size: tuple[int, int]) -> Image.Image:
    # Seeded by a hash of the whole name: a benchmark's "unique" images must not
    # repeat (seeding by the sum of the characters rendered profile-12 and
    # profile-21 alike, so bench.profile measured cache hits).
    rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big"))
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x / max(w, 1), y / max(h, 1), (x + y) / max(w + h, 1)], axis=-1)
    pixels = (base * rng.uniform(80, 255, 3) + rng.normal(0, 4, (h, w, 3))).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        r = int(rng.integers(2, max(3, min(w, h) // 3)))
        draw.ellipse((x0 - r, y0 - r, x0 + r, y0 + r), fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    return image


def encode(image: Image.Image, fmt: str = "JPEG", quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def data_url(image: Image.Image, fmt: str = "JPEG") -> str:
    """The image as a `data:` URL, the way a client inlines it in a chat request."""
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(encode(image, fmt)).decode()}"
