"""The OpenAI chat-completions request, validated at the HTTP edge.

Unknown fields are refused (extra="forbid"): a field that would change the
result and that Prism does not honour must never be a quiet no-op. Fields
that change nothing about the result (`user`, `metadata`, `store`,
`service_tier`) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class PixelOverrides(_Strict):
    """vLLM's `mm_processor_kwargs`: a per-request pixel budget, within the deployment's."""

    min_pixels: int | None = Field(None, ge=1)
    max_pixels: int | None = Field(None, ge=1)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk too


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None  # token id → bias in [-100, 100] (OpenAI sends ids as strings)
    # vLLM's sampling extensions (`extra_body` in the openai SDK); unset: the
    # checkpoint's generation_config.json value, else vLLM's default.
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    mm_processor_kwargs: PixelOverrides | None = None
    # vLLM's extensions for fixed output lengths (benchmarks, load tests).
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # Accepted, and change nothing about the result.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and len(value) > 300:
            raise ValueError("at most 300 token biases")
        if value and any(not -100 <= bias <= 100 for bias in value.values()):
            raise ValueError("each bias must be between -100 and 100")
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> "ChatCompletionRequest":
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({limit})")
        return self

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value != 1:
            raise PydanticCustomError("unsupported", "only n=1 is supported")
        return value
