"""Messages into the vision encoder (sent by the gateway)."""

from __future__ import annotations

import msgspec

from protocol.base import Hello, Message
from protocol.stats import StatsRequest
from protocol.tensors import ArrayMeta
from protocol.video import EncodeVideos


class ImageInput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    # BLAKE3 over the original image bytes and the gateway's intake policy (cache/keys.py);
    # the encoder adds its own model and processor identity to form the cache key.
    digest: bytes
    # uint8 (height, width, 3), one frame per image that has pixels, in order.
    # None: "look it up only" — a cache hit then costs the gateway no decoding.
    pixels: ArrayMeta | None = None
    # (height, width) before the gateway downscaled it: LLaVA-OneVision cuts the
    # padding of its tiles by the original aspect ratio, as vLLM does on the raw image.
    original_size: tuple[int, int] | None = None
    # The pixels are at the size vLLM's processor makes of the original under the
    # request's budget: a Qwen family's encoder must not size them again under its own.
    sized: bool = False


class EncodeRequest(Message):
    request_id: str
    images: list[ImageInput]
    retry: bool = False  # its lookups were counted already: it answers an EncodeNeedsPixels, or another replica refused it
    # The engine this request will go to (its address, as the gateway knows it):
    # each image encoded for it is pushed there (PushedEmbedding) the moment its
    # batch ends, so the tokens travel while the gateway makes the request.
    # "": none; the engine fetches them.
    push_to: str = ""
    priority: int = 0  # the chat request's (vLLM's `priority`: lower first): the encoder's queue is ordered by it


class CancelEncode(Message):
    request_id: str


class FetchEmbeddings(Message):
    """From an engine: the tensors of images this encoder encoded or looked up
    for a request (EncodedImage.key and .identity), answered with FetchedEmbeddings."""

    fetch_id: str
    keys: list[bytes]
    identities: list[bytes]


EncoderInbound = EncodeRequest | EncodeVideos | CancelEncode | FetchEmbeddings | Hello | StatsRequest
