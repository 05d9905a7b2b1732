"""Messages into the LLM engine (sent by the gateway)."""

from __future__ import annotations

import msgspec

from protocol.base import Hello, Message
from protocol.stats import StatsRequest
from protocol.tensors import ArrayMeta


class ChatPart(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    type: str  # "text" or "image"; images are numbered by order of appearance
    text: str = ""


class ChatMessage(msgspec.Struct, array_like=True, frozen=True, gc=False):
    role: str
    content: list[ChatPart]


class SamplingOptions(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    max_tokens: int | None = None  # None: up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0


class ImageEmbedding(msgspec.Struct, array_like=True, frozen=True, gc=False):
    embeddings: ArrayMeta  # (tokens, hidden), one frame per image, in order
    grid_thw: tuple[int, int, int]


class GenerateRequest(Message):
    request_id: str
    messages: list[ChatMessage]
    sampling: SamplingOptions
    images: list[ImageEmbedding] = []
    stream: bool = True


class AbortGenerate(Message):
    request_id: str


EngineInbound = GenerateRequest | AbortGenerate | Hello | StatsRequest
