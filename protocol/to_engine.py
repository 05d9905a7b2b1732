"""Messages into the LLM engine: requests from the gateway, and the encoders'
answers to the engine's fetches of visual tokens."""

from __future__ import annotations

import msgspec

from protocol.base import Hello, Message
from protocol.stats import StatsRequest
from protocol.tensors import ArrayMeta
from protocol.video import VideoEmbedding


class ImageEmbedding(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One image's visual tokens, by reference: the tensor never travels in a
    GenerateRequest; the engine finds it by `key` (llm_engine/images.py)."""

    embeddings: ArrayMeta  # (tokens, hidden): what the tensor is, checked before it is fetched
    grid_thw: tuple[int, int, int] | None  # Qwen's families; None where the family has no grid
    # The encoder's content key: handed to vLLM as the image's `multi_modal_uuids`
    # entry, so vLLM neither hashes the tensor nor keys its prefix cache on
    # anything else; and the key the engine fetches it by.
    key: bytes
    # The encoder address that holds the tensor (the engine fetches it from
    # there, or finds it in its own LRU or the shared tier).
    source: str
    identity: bytes  # what `key` was hashed from: checked on every fetch (cache/lru.py)
    # `source` pushed the tensor to this engine as it encoded it (PushedEmbedding):
    # it may still be on its way; the engine waits for it before fetching.
    pushed: bool = False


def reference(image, source: str) -> ImageEmbedding:
    """An encoder's answer for one image (to_gateway.EncodedImage) as the engine
    takes it: fetched from `source` unless it was pushed there."""
    return ImageEmbedding(image.embeddings, image.grid_thw, image.key, source, image.identity, image.pushed)


# What an image part's URL says once its pixels have become embeddings.
IMAGE_PLACEHOLDER = "prism:embedding"


class GenerateRequest(Message):
    """`chat` is the client's OpenAI chat request as the gateway validated it
    (JSON), each image part's URL replaced by IMAGE_PLACEHOLDER, and `images`
    the references to their embeddings, in order of appearance. The engine reads it with
    vLLM's own ChatCompletionRequest, so sampling, structured outputs and tools
    mean exactly what they mean on vLLM's server (llm_engine/requests.py)."""

    request_id: str
    chat: bytes
    images: list[ImageEmbedding] = []
    # each video part's tokens by reference, in order of appearance (found as images' are)
    videos: list[VideoEmbedding] = []
    # the chat's (vLLM's priority), read before the chat is: in a full queue an engine that schedules
    # by priority lets a more urgent request take the least urgent waiting one's place
    priority: int = 0

    def unpushed(self) -> "GenerateRequest":
        """This request for an engine no encoder pushed its tokens to (a failover):
        it fetches them at once instead of waiting for pushes that are not coming."""
        if not any(item.pushed for item in (*self.images, *self.videos)):
            return self
        images = [msgspec.structs.replace(image, pushed=False) for image in self.images]
        videos = [msgspec.structs.replace(video, pushed=False) for video in self.videos]
        return msgspec.structs.replace(self, images=images, videos=videos)


class AbortGenerate(Message):
    request_id: str


class PushedEmbedding(Message):
    """From an encoder, unasked: an image's tokens, encoded for a request the
    gateway is about to send here (EncodeRequest.push_to). One frame."""

    key: bytes
    identity: bytes
    embeddings: ArrayMeta
    grid_thw: tuple[int, int, int] | None


EngineInbound = GenerateRequest | AbortGenerate | PushedEmbedding | Hello | StatsRequest


class FetchedEmbeddings(Message):
    """An encoder's answer to FetchEmbeddings: one entry per key, in order;
    None where it no longer holds that key. One frame per tensor found."""

    fetch_id: str
    found: list[ArrayMeta | None]


FetchInbound = FetchedEmbeddings
