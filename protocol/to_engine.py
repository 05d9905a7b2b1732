"""Messages into the LLM engine (sent by the gateway)."""

from __future__ import annotations

import msgspec

from protocol.base import Hello, Message
from protocol.stats import StatsRequest
from protocol.tensors import ArrayMeta


class ImageEmbedding(msgspec.Struct, array_like=True, frozen=True, gc=False):
    embeddings: ArrayMeta  # (tokens, hidden), one frame per image, in order
    grid_thw: tuple[int, int, int] | None  # Qwen's families; None where the family has no grid
    # The encoder's content key: handed to vLLM as the image's `multi_modal_uuids`
    # entry, so vLLM neither hashes the tensor nor keys its prefix cache on
    # anything else. Empty: vLLM hashes the embeddings itself.
    key: bytes = b""


# What an image part's URL says once its pixels have become embeddings.
IMAGE_PLACEHOLDER = "prism:embedding"


class GenerateRequest(Message):
    """`chat` is the client's OpenAI chat request as the gateway validated it
    (JSON), each image part's URL replaced by IMAGE_PLACEHOLDER and its pixels
    by the embeddings here, in order of appearance. The engine reads it with
    vLLM's own ChatCompletionRequest, so sampling, structured outputs and tools
    mean exactly what they mean on vLLM's server (llm_engine/requests.py)."""

    request_id: str
    chat: bytes
    images: list[ImageEmbedding] = []


class AbortGenerate(Message):
    request_id: str


EngineInbound = GenerateRequest | AbortGenerate | Hello | StatsRequest
