"""The OpenAI chat-completions request, validated at the HTTP edge.

Unknown fields are refused (extra="forbid"): a field that would change the
result and that Prism does not honour must never be a quiet no-op. Fields
that change nothing about the result (`user`, `metadata`, `store`,
`service_tier`, OpenAI's prompt-cache hints) are accepted and not forwarded.
A field sent as null asks for nothing, as in OpenAI's API: it is read as
absent, whatever the field (clients send null for what they leave unset, and
the SDK sends an assistant reply's null `refusal` and `audio` back with it).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError


class _Strict(BaseModel):
    # NaN and infinities are not JSON (the reader takes `NaN`, `Infinity` and `1e400`): sent on, they
    # would become null. Free-form JSON fields are checked by `JSONObject`.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def unsupported(message: str) -> PydanticCustomError:
    """A value OpenAI's API defines that Prism does not serve: a 400 naming the field (parsing.validation_error)."""
    return PydanticCustomError("unsupported", message)


def invalid(field: str, message: str) -> PydanticCustomError:
    """A value wrong beside another field's, found by a check of the whole request (which has no
    location of its own): a 400 naming `field` (parsing.validation_error)."""
    return PydanticCustomError("invalid_field", message, {"field": field})


# A field that changes nothing about the answer: accepted, and never forwarded to the engine.
_NOT_FORWARDED = Field(None, exclude=True)


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high", "original"] = "auto"

    @field_validator("detail")
    @classmethod
    def _served_detail(cls, detail: str) -> str:
        if detail == "original":
            raise unsupported("'original' (no downscaling) is not served: every image is held to the model's pixel "
                              "budget; send 'auto', 'low' or 'high'")
        return detail


class PromptCacheBreakpoint(_Strict):
    ttl: Literal["30m"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = _NOT_FORWARDED


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = _NOT_FORWARDED


class VideoURL(_Strict):
    url: str  # data: (base64) or http(s)


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


class RefusalPart(_Strict):
    """An earlier answer's refusal, sent back in an assistant message: the model reads it as text, as on vLLM."""
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | ImagePart | VideoPart | RefusalPart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]  # required, as OpenAI and vLLM have it: the engine reads the call with vLLM's types
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    # assistant: the reasoning an earlier answer came with (engine.reasoning_parser),
    # sent back with it; the chat template decides whether the model sees it, as on vLLM.
    reasoning: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _reasoning_content(cls, data: Any) -> Any:
        """`reasoning_content`, the older name clients still send it back under, is `reasoning` (as vLLM reads it)."""
        if isinstance(data, dict) and "reasoning_content" in data:
            data = dict(data)
            renamed = data.pop("reasoning_content")
            if data.get("reasoning") is None:
                data["reasoning"] = renamed
        return data

    @model_validator(mode="after")
    def _role_fields(self) -> "Message":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning")
        if self.content is None and self.role != "assistant":
            # an answer may come with null content (a call, or stopped inside its reasoning: gateway/api/responses.py),
            # and is sent back so; vLLM renders it as empty
            raise ValueError("content is required (only an assistant message may omit it)")
        if self.role != "assistant" and isinstance(self.content, list) and any(isinstance(p, RefusalPart) for p in self.content):
            raise ValueError("only assistant messages carry refusal parts")
        if self.role == "tool" and isinstance(self.content, list) and any(isinstance(p, ImagePart | VideoPart) for p in self.content):
            raise ValueError("a tool message carries text only (chat templates render tool results as text)")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)  # any, as vLLM's server takes it (OpenAI's own allows no dots)
    description: str | None = None
    parameters: JSONObject | None = None  # a JSON Schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchema(_Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(min_length=1)
    description: str | None = None
    schema_: JSONObject = Field(alias="schema")  # vLLM's server constrains nothing without one
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one constraint, run by
    vLLM's structured-output backend (xgrammar or guidance, as vLLM picks).
    vLLM's per-request `disable_any_whitespace`, `disable_additional_properties`
    and `whitespace_pattern` are taken at their defaults only (vLLM's backends
    read them from the engine's config alone: engine.structured_outputs)."""

    json_: JSONObject | Annotated[str, Field(min_length=1)] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: Literal[True] | None = None
    disable_any_whitespace: bool = Field(False, exclude=True)
    disable_additional_properties: bool = Field(False, exclude=True)
    whitespace_pattern: str | None = Field(None, exclude=True)

    @field_validator("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
    @classmethod
    def _engine_wide(cls, value):
        if value:
            raise unsupported("set for the whole engine (engine.structured_outputs), not per request: "
                              "vLLM's backends read it from there alone")
        return value

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _one_constraint(self) -> "StructuredOutputs":
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of json, regex, choice, grammar, json_object must be given")
        return self


class PixelOverrides(_Strict):
    """vLLM's `mm_processor_kwargs`: a per-request pixel budget, within the deployment's."""

    min_pixels: int | None = Field(None, ge=1)
    max_pixels: int | None = Field(None, ge=1)


class VideoSamplingKwargs(_Strict):
    """vLLM's `media_io_kwargs["video"]`: the arguments of its video loader,
    which decide the frames kept (gateway/intake/video/sampling.py). Unset: the
    loader's defaults (fps 2, min_frames 4, max_frames 768 for Qwen)."""

    fps: float | None = Field(None, gt=0, le=240)
    num_frames: int | None = Field(None, ge=1, le=10_000)  # the uniform loader's; Qwen's loaders sample by fps
    min_frames: int | None = Field(None, ge=1, le=10_000)
    max_frames: int | None = Field(None, ge=1, le=10_000)

    @model_validator(mode="after")
    def _min_within_max(self) -> "VideoSamplingKwargs":
        if self.min_frames is not None and self.max_frames is not None and self.min_frames > self.max_frames:
            raise ValueError(f"min_frames ({self.min_frames}) exceeds max_frames ({self.max_frames})")
        return self


class MediaIOKwargs(_Strict):
    """vLLM's per-request `media_io_kwargs`, keyed by modality: only video's are taken."""

    video: VideoSamplingKwargs | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk too
    include_obfuscation: bool | None = _NOT_FORWARDED  # OpenAI's padding against length side channels: none is added

    @model_validator(mode="after")
    def _usage_asked(self) -> "StreamOptions":
        if self.continuous_usage_stats and not self.include_usage:  # vLLM's server then sends none
            raise ValueError("continuous_usage_stats needs include_usage: true")
        return self


class PromptCacheOptions(_Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


def _unsendable(value: Any, path: str = "") -> tuple[str, str] | None:
    """Where in `value` a number vLLM's engine cannot carry is, and why, or None: a NaN or an
    infinity, or an integer past 64 bits (msgpack, the wire of vLLM's engine core, has none,
    and vLLM failed on it after the images' encode)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, "numbers must be finite (NaN and infinities are not JSON)"
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return path, "integers must fit in 64 bits"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _unsendable(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


def _sendable(value: dict[str, Any]) -> dict[str, Any]:
    if (found := _unsendable(value)) is not None:
        within, message = found
        raise PydanticCustomError("unsendable_number", message, {"within": within})
    return value


# A free-form JSON object (a schema, a tool's parameters, template arguments), walked for the
# numbers vLLM's engine core cannot carry. Typed fields are checked by their types (`Int64`,
# `allow_inf_nan`): a walk of the whole body cost a Python call per value, seconds of the
# event loop for a body of a few million numbers.
JSONObject = Annotated[dict[str, Any], AfterValidator(_sendable)]


# A 64-bit integer: what vLLM's engine core takes (its messages are msgpack); past it a request
# would fail inside vLLM, after its images were fetched and encoded.
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]


class RepetitionDetection(_Strict):
    """vLLM's: a choice that repeats a pattern of min..max_pattern_size tokens min_count times
    in a row ends there, finish_reason "repetition" (all zero: off)."""

    # At most 1024 tokens (vLLM sets no bound): vLLM checks every pattern length up to it at every step,
    # in its engine core, which every request shares.
    max_pattern_size: int = Field(0, ge=0, le=1024)
    min_pattern_size: int = Field(0, ge=0)  # 0: 1
    min_count: Int64 = Field(0, ge=0)

    @model_validator(mode="after")
    def _a_pattern_to_find(self) -> "RepetitionDetection":  # vLLM's rules, said before any intake
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(f"min_pattern_size ({self.min_pattern_size}) exceeds max_pattern_size ({self.max_pattern_size})")
        if self.max_pattern_size and self.min_count < 2:
            raise ValueError("min_count must be at least 2 (a pattern repeated that many times ends the choice)")
        return self


class ChatCompletionRequest(_Strict):
    model: str | None = None  # None: the one model served (vLLM's server takes it so); several: a 400 naming them
    messages: list[Message] = Field(min_length=1)
    max_tokens: Int64 | None = Field(None, ge=1)
    max_completion_tokens: Int64 | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Int64 | None = None  # vLLM's: a 64-bit integer
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)  # at most gateway.max_n
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's: the prompt's and each choice's token ids in the answer; logprobs' tokens as "token_id:<id>"
    # (without logprobs it changes nothing, and is taken as vLLM's server takes it: RL clients send it always)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's: each prompt position's logprob (0: the prompt's own token; k: its k likeliest too), answered
    # whole only, as vLLM's server gives them; at most 20, as vLLM's engine allows by default (max_logprobs).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's: each step's logprobs for these ids (a classifier's labels), in place of top_logprobs; at
    # most 128, as vLLM's sampler holds them
    logprob_token_ids: list[Annotated[Int64, Field(ge=0)]] | None = Field(None, max_length=128)  # []: unset, as vLLM reads it
    # vLLM's: the prompt text the chat template made, in the answer (a stream's role chunks)
    return_prompt_text: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    tools: list[Tool] | None = Field(None, min_length=1)  # [] refused, as vLLM and OpenAI refuse it
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: JSONObject | None = None  # e.g. Qwen3's enable_thinking
    # OpenAI's; reaches the chat template as vLLM's server passes it (llm_engine/requests.py: template_kwargs)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning (engine.reasoning_parser) out of the answer
    # vLLM's: the reasoning is ended (its end marker written) after this many tokens; -1: no budget.
    # Strict, as vLLM's: neither true nor 3.0 is a number of tokens.
    thinking_token_budget: Annotated[StrictInt, Field(ge=-1, le=2**63 - 1)] | None = None
    # vLLM's: how the conversation's end is rendered; continue_final_message (with add_generation_prompt
    # false) has the model go on with the last message, e.g. an assistant answer begun by the client.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the final message, where it is in the answer's role, opens the answer (`echoed`)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[Int64, float] | None = None  # token id → bias, held to [-100, 100] by vLLM (OpenAI sends ids as strings)
    # vLLM's sampling extensions (`extra_body` in the openai SDK); unset: the
    # checkpoint's generation_config.json value, else vLLM's default.
    top_k: int | None = Field(None, ge=-1, le=2**63 - 1)  # -1 or 0: off; past the vocabulary, all of it
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's bound
    stop_token_ids: list[Int64] = Field(default_factory=list)
    allowed_token_ids: list[Annotated[Int64, Field(ge=0)]] | None = Field(None, min_length=1)  # sampling keeps to these
    bad_words: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)  # never written (vLLM bans each one's last token after the rest)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_detection: RepetitionDetection | None = None
    # vLLM's: tokens per streamed chunk (the first and last chunks leave at once); unstreamed, vLLM's server
    # ignores it. At most 1024: each of a stream's replies must come within gateway.generate_timeout_s.
    stream_interval: int | None = Field(None, ge=1, le=1024)
    # vLLM's: the tokenizer's own special tokens (e.g. a BOS) added to the chat template's prompt
    add_special_tokens: bool = False
    # vLLM's: the prompt cut to this many tokens (-1: the context's, less one for the answer), from the
    # side truncation_side says (unset: the tokenizer's, which keeps the first); never through an image
    truncate_prompt_tokens: Int64 | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    mm_processor_kwargs: PixelOverrides | None = None
    media_io_kwargs: MediaIOKwargs | None = None  # video sampling (gateway/intake/video/)
    # vLLM's: lower is served first where the engine schedules by priority (engine.scheduling_policy),
    # and so is the request's place in the encoders' queues; `X-Vllm-Priority` sets it too, as on vLLM's server.
    priority: Int64 = 0
    # vLLM's: the request's prompt prefix and its visual tokens are cached apart from every other salt's
    # (vLLM's prefix cache; the encoders', engines' and gateway's token caches: cache/keys.py `salted`).
    cache_salt: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    # vLLM's extensions for fixed output lengths (benchmarks, load tests).
    ignore_eos: bool = False
    min_tokens: Int64 = Field(0, ge=0)
    # Accepted, and change nothing about the result (OpenAI's prompt-cache hints too: Prism caches every prefix by itself).
    user: str | None = _NOT_FORWARDED
    safety_identifier: str | None = _NOT_FORWARDED
    metadata: dict[str, Any] | None = _NOT_FORWARDED
    store: bool | None = _NOT_FORWARDED
    service_tier: str | None = _NOT_FORWARDED
    prompt_cache_key: str | None = _NOT_FORWARDED
    prompt_cache_retention: Literal["in_memory", "24h"] | None = _NOT_FORWARDED
    prompt_cache_options: PromptCacheOptions | None = _NOT_FORWARDED
    session_id: str | None = _NOT_FORWARDED  # vLLM's: tags its KV-cache events, which Prism does not publish
    request_id: str | None = _NOT_FORWARDED  # vLLM's: refused, for the header that does it here (_id_by_header)
    modalities: list[Literal["text", "audio"]] | None = _NOT_FORWARDED

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, modalities: list[str]) -> list[str]:
        if "audio" in modalities:
            raise unsupported("Prism answers in text only: send [\"text\"] or leave modalities out")
        return modalities

    @field_validator("request_id")
    @classmethod
    def _id_by_header(cls, _: str) -> str:
        raise unsupported("send the request's id as the X-Request-Id header: Prism names the request, its logs "
                          "and its answer's id after it from there, before reading the body")

    @field_validator("cache_salt")
    @classmethod
    def _salt_vllm_takes(cls, salt: str) -> str:
        if any(char in salt for char in "@/\\\x00"):  # vLLM's rule: its cache backends key by it
            raise ValueError("a cache_salt must not contain '@', '/', '\\' or NUL (as vLLM's server requires)")
        return salt

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _one_output_limit(self) -> "ChatCompletionRequest":
        """vLLM takes max_completion_tokens over max_tokens: a different max_tokens beside it would be
        ignored, so it is refused (the same number twice, as some clients send it, is one limit)."""
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise invalid("max_tokens", f"max_tokens ({both[0]}) and max_completion_tokens ({both[1]}) differ; send one "
                          "(max_completion_tokens is the one OpenAI's API documents)")
        return self

    @model_validator(mode="after")
    def _one_way_to_end(self) -> "ChatCompletionRequest":
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:  # a new turn's header after the message to go on with
            raise invalid("continue_final_message", "continue_final_message needs add_generation_prompt: false "
                          "(a new turn cannot open after the message the model is to continue)")
        # The template's text is cut where the message's last text ends (transformers'): what follows it would be lost.
        final = self.messages[-1]
        if final.tool_calls:
            raise invalid("continue_final_message", "the final message carries tool_calls, which the model cannot "
                          "continue (the prompt ends at its text, so they would be left out)")
        last_part = final.content[-1] if isinstance(final.content, list) and final.content else None
        if final.content is None or final.content == [] or (last_part is not None and not isinstance(last_part, TextPart | RefusalPart)):
            raise invalid("continue_final_message", "the final message must end with text for the model to continue "
                          "(the prompt ends where its last text ends: an image or video after it would be left out)")
        return self

    @property
    def response_role(self) -> str:
        """The answer's role, as vLLM's server gives it: the final message's where no new turn opens."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echoed(self) -> str | None:
        """What `echo` puts before each choice's content, as vLLM's server does: the final message's
        text where it is in the answer's role, else ""; None without echo."""
        if not self.echo:
            return None
        final = self.messages[-1]
        if final.role != self.response_role or final.content is None:
            return ""
        if isinstance(final.content, str):
            return final.content
        return "\n".join(part.text if isinstance(part, TextPart) else part.refusal for part in final.content)

    @model_validator(mode="after")
    def _text_to_echo(self) -> "ChatCompletionRequest":
        final = self.messages[-1]
        if self.echo and final.role == self.response_role and isinstance(final.content, list) \
                and any(isinstance(part, ImagePart | VideoPart) for part in final.content):
            raise invalid("echo", "echo repeats the final message's text, and this one carries an image or video; "
                          "send the echo's text alone")
        return self

    @model_validator(mode="after")
    def _one_effort(self) -> "ChatCompletionRequest":
        given = (self.chat_template_kwargs or {}).get("reasoning_effort")
        if self.reasoning_effort is not None and given is not None and given != self.reasoning_effort:  # vLLM's server takes the field's
            raise invalid("reasoning_effort", f"reasoning_effort ({self.reasoning_effort!r}) and chat_template_kwargs."
                          f"reasoning_effort ({given!r}) differ; send one")
        return self

    @model_validator(mode="after")
    def _what_reasoning_hides(self) -> "ChatCompletionRequest":
        for shown, field in ((self.logprobs, "logprobs"), (self.return_token_ids, "return_token_ids")):
            if shown and not self.include_reasoning:  # vLLM's server drops them: their tokens would spell it out
                raise invalid(field, f"{field} with include_reasoning: false would spell out the reasoning it hides "
                              "(vLLM's server leaves them out); send one or the other")
        return self

    @model_validator(mode="after")
    def _truncation_asked(self) -> "ChatCompletionRequest":
        if self.truncation_side is not None and self.truncate_prompt_tokens is None:  # vLLM's server ignores it
            raise invalid("truncation_side", "truncation_side says where truncate_prompt_tokens cuts the prompt: send both")
        return self

    @model_validator(mode="after")
    def _chosen_logprobs(self) -> "ChatCompletionRequest":
        if not self.logprob_token_ids:
            self.logprob_token_ids = None  # vLLM's server reads [] as unset
            return self
        if not self.logprobs:
            raise invalid("logprob_token_ids", "logprob_token_ids needs logprobs: true")
        if self.top_logprobs:  # vLLM's server gives the chosen ids' logprobs in their place, saying nothing
            raise invalid("logprob_token_ids", "logprob_token_ids name each step's top_logprobs themselves: "
                          "send top_logprobs 0 or leave it out")
        return self

    @model_validator(mode="after")
    def _min_within_max(self) -> "ChatCompletionRequest":
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None and self.min_tokens > limit:
            raise invalid("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens ({limit})")
        return self

    @model_validator(mode="after")
    def _options_that_need_each_other(self) -> "ChatCompletionRequest":
        if self.prompt_logprobs is not None and self.stream:  # vLLM's server refuses them (but 0, which it drops)
            raise invalid("prompt_logprobs", "prompt_logprobs come with a whole answer only, as on vLLM's server: send stream: false")
        # as vLLM's server says, which lets an empty one ({}) pass
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise invalid("stream_options", "stream_options needs stream: true")
        # vLLM's server would let the response_format replace the structured output's constraint
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise invalid("structured_outputs", "response_format and structured_outputs each constrain the output: send one")
        if self.temperature == 0 and self.n > 1:  # vLLM's sampling refuses it: n greedy choices would be one
            raise invalid("n", f"n = {self.n} choices with temperature 0 (greedy) would be {self.n} copies of one: send n 1 or a temperature")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _logprobs_asked(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice, info: ValidationInfo):
        tools = info.data.get("tools") or []
        if choice in (None, "none"):
            return choice
        if not tools:
            raise ValueError(f"tool_choice {choice if isinstance(choice, str) else choice.function.name!r} needs tools")
        if not isinstance(choice, str) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return choice
