"""Many large uploads at once: one chat request a 4K JPEG (about 3.5 MB, 4.7 MB
as base64), all started together, each answered or failed on its own.

Every request's image is unique to the byte (a JPEG comment of its own right
after the start marker), so no cache answers it and each is decoded and
encoded; yet the client holds one copy of the image, shared by every body in
256 KiB pieces, so a thousand uploads cost it little memory. A slow upload
sends its pieces at a set rate, as a client on a poor link would.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import numpy as np
from PIL import Image

from loadtest.synthetic import make_image

PIECE = 256 * 1024
COMMENT = 30  # bytes of each JPEG's own comment: start marker (2) + marker (2) + length (2) + 30 = 36, a multiple of 3


def large_jpeg(size: tuple[int, int] = (3840, 2160), noise: float = 16) -> bytes:
    """A photo-like picture with grain (as a camera's), about 3.5 MB at quality 90 in 4K."""
    pixels = np.asarray(make_image("burst", size)).astype(np.int16)
    grain = np.random.default_rng(0).normal(0, noise, pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray((pixels + grain).clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@dataclass(frozen=True)
class Uploads:
    """Request bodies that differ only in each image's first 36 bytes: a body
    is [head, *shared pieces, tail], and base64 of 36 bytes ends on a whole
    quantum, so the shared part's base64 is the same in every body."""

    head: bytes  # the JSON before the data URL's payload
    shared: tuple[bytes, ...]  # base64 of the image after its first 2 bytes, in pieces
    tail: bytes
    tag: str  # this run's: images of another run are not these

    @classmethod
    def of(cls, jpeg: bytes, model: str, tag: str, max_tokens: int = 8) -> "Uploads":
        body = json.dumps({"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,@"}},
            {"type": "text", "text": "What colour is the circle?"}]}]}).encode()
        head, _, tail = body.partition(b"@")
        rest = base64.b64encode(jpeg[2:])
        return cls(head, tuple(rest[i:i + PIECE] for i in range(0, len(rest), PIECE)), tail, tag)

    def pieces(self, index: int) -> list[bytes]:
        comment = f"{self.tag}-{index}".encode().ljust(COMMENT)[:COMMENT]
        first = b"\xff\xd8\xff\xfe" + (COMMENT + 2).to_bytes(2, "big") + comment  # start of image, then a comment segment
        return [self.head + base64.b64encode(first), *self.shared, self.tail]

    def length(self) -> int:
        return len(self.head) + 48 + sum(map(len, self.shared)) + len(self.tail)


@dataclass(frozen=True)
class Answer:
    outcome: str  # "200", "429", "503 (no Retry-After)", "ReadError", ...
    seconds: float


async def _paced(pieces: list[bytes], bytes_per_s: float | None):
    for piece in pieces:
        yield piece
        if bytes_per_s:
            await asyncio.sleep(len(piece) / bytes_per_s)


async def upload(client: httpx.AsyncClient, url: str, uploads: Uploads, index: int, bytes_per_s: float | None) -> Answer:
    started = time.perf_counter()
    headers = {"content-type": "application/json", "content-length": str(uploads.length())}
    try:
        response = await client.post(url, content=_paced(uploads.pieces(index), bytes_per_s), headers=headers)
    except httpx.HTTPError as exc:
        return Answer(type(exc).__name__, time.perf_counter() - started)
    outcome = str(response.status_code)
    if response.status_code in (429, 503) and "retry-after" not in response.headers:
        outcome += " (no Retry-After)"
    return Answer(outcome, time.perf_counter() - started)


async def burst(base_url: str, uploads: Uploads, count: int, first: int = 0, bytes_per_s: float | None = None,
                timeout_s: float = 600) -> list[Answer]:
    """`count` uploads started at once, each on its own connection."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        url = f"{base_url}/v1/chat/completions"
        return await asyncio.gather(*(upload(client, url, uploads, first + i, bytes_per_s) for i in range(count)))


def by_outcome(answers: list[Answer]) -> dict[str, int]:
    return dict(sorted(Counter(a.outcome for a in answers).items()))
