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
    """What the client sent; None where it sent nothing (the engine fills in the
    checkpoint's generation_config.json defaults, then OpenAI's)."""

    max_tokens: int | None = None  # None: up to the model's context length
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = []
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = {}
    stop_token_ids: list[int] = []
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
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
