"""OpenAI response bodies: chat.completion, chat.completion.chunk, SSE framing.

The engine sends each step's choices as ChoiceDelta (content, reasoning,
logprobs, tool-call pieces); a non-streamed answer is their sum (`Answer`),
a streamed one sends each as a chunk (`stream_choice`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from protocol.to_gateway import ChoiceDelta, TokenDelta, ToolCallDelta


def usage(delta: TokenDelta, image_tokens: int, completion_tokens: int | None = None, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage from the latest token delta (all choices together, unless
    `completion_tokens` counts one): vLLM's prefix-cache hits as `cached_tokens`,
    and Prism's own count of the prompt's visual tokens; `reasoning_tokens`
    where the engine counts them (a reasoning parser), as vLLM's server does."""
    completion_tokens = delta.completion_tokens if completion_tokens is None else completion_tokens
    body = {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": delta.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.cached_tokens, "image_tokens": image_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


class ReasoningCounts:
    """Each choice's reasoning tokens, as the engine last counted them (none counted: no reasoning parser)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}

    def add(self, delta: TokenDelta) -> None:
        for choice in delta.choices:
            if choice.reasoning_tokens is not None:
                self._counts[choice.index] = choice.reasoning_tokens

    def of(self, index: int) -> int | None:
        return self._counts.get(index, 0) if self._counts else None

    def total(self) -> int | None:
        return sum(self._counts.values()) if self._counts else None


def _logprob_content(choice: ChoiceDelta) -> list[dict] | None:
    """The entries of OpenAI's chat logprobs `content` (the wire's structs travel as arrays)."""
    if choice.logprobs is None:
        return None
    return [
        {"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
         "top_logprobs": [{"token": x.token, "logprob": x.logprob, "bytes": x.bytes} for x in t.top_logprobs]}
        for t in choice.logprobs
    ]


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def add(self, piece: ToolCallDelta) -> None:
        self.id = self.id or piece.id
        self.name = self.name or piece.name
        self.arguments.append(piece.arguments)

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": "".join(self.arguments)}}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[dict] | None = None
    calls: dict[int, _Call] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)

    def add(self, delta: ChoiceDelta) -> None:
        self.text.append(delta.text or "")
        self.token_ids.extend(delta.token_ids or ())
        self.reasoning.append(delta.reasoning)
        if (content := _logprob_content(delta)) is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(content)
        for piece in delta.tool_calls:
            self.calls.setdefault(piece.index, _Call()).add(piece)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason

    def body(self, index: int, shape: "AnswerShape") -> dict:
        text, reasoning = "".join(self.text), "".join(self.reasoning)
        # as vLLM answers: null beside calls or reasoning with no text after them (cut off while
        # reasoning), but a string whenever tool_choice forced a call
        content = text if text or shape.forced_call or not (self.calls or reasoning) else None
        if shape.echoed is not None:  # vLLM's server: a string whatever came after it
            content = shape.echoed + (content or "")
        message: dict = {"role": shape.role, "content": content}
        if reasoning and shape.shows_reasoning:
            message["reasoning"] = reasoning
        if self.calls:
            message["tool_calls"] = [self.calls[i].body() for i in sorted(self.calls)]
        logprobs = None if self.logprobs is None else {"content": self.logprobs}
        body = {"index": index, "message": message, "finish_reason": self.finish_reason, "stop_reason": self.stop_reason, "logprobs": logprobs}
        return body | ({"token_ids": self.token_ids} if shape.token_ids else {})


@dataclass(frozen=True)
class AnswerShape:
    """What of the request shapes its answer's messages."""

    forced_call: bool = False  # tool_choice required or a named function
    role: str = "assistant"  # ChatCompletionRequest.response_role
    shows_reasoning: bool = True  # include_reasoning
    token_ids: bool = False  # return_token_ids: each choice's, and the prompt's
    echoed: str | None = None  # ChatCompletionRequest.echoed: before each choice's content

    @classmethod
    def of(cls, request) -> "AnswerShape":
        return cls(request.tool_choice not in (None, "none", "auto"), request.response_role, request.include_reasoning,
                   request.return_token_ids, request.echoed)


class Answer:
    """A non-streamed answer: every delta of every choice, summed."""

    def __init__(self, shape: AnswerShape = AnswerShape()) -> None:
        self._choices: dict[int, _Choice] = {}
        self._shape = shape

    def add(self, delta: TokenDelta) -> None:
        for choice in delta.choices:
            self._choices.setdefault(choice.index, _Choice()).add(choice)

    def choices(self) -> list[dict]:
        return [self._choices[i].body(i, self._shape) for i in sorted(self._choices)]


def completion(request_id: str, model: str, choices: list[dict], usage_: dict, timings: dict,
               first: TokenDelta | None = None) -> dict:
    """`first`: the answer's first delta, which carries the prompt's token ids and logprobs where asked."""
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
        "prism": timings,
    }
    if first is not None and first.prompt_logprobs is not None:
        body["prompt_logprobs"] = [None if at is None else {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
                                                            for e in at} for at in first.prompt_logprobs]
    if first is not None:
        body |= prompt_extras(first)
    return body


def prompt_extras(first: TokenDelta) -> dict:
    """What vLLM's server tells of the prompt where the request asked: with a whole answer, and in each
    choice's role chunk."""
    extras = {"prompt_token_ids": first.prompt_token_ids, "prompt_text": first.prompt_text}
    return {name: value for name, value in extras.items() if value is not None}


def role_entry(index: int, role: str = "assistant") -> dict:
    """A choice's first chunk entry, before any of its tokens (as OpenAI and vLLM's server send it)."""
    return {"index": index, "delta": {"role": role, "content": ""}, "finish_reason": None, "logprobs": None}


def echo_entry(index: int, echoed: str) -> dict:
    """A choice's `echo` chunk entry, after its role's."""
    return {"index": index, "delta": {"content": echoed}, "finish_reason": None, "logprobs": None}


def stream_choice(choice: ChoiceDelta) -> dict | None:
    """One choice's chunk entry; None when it says nothing (e.g. tool-call
    markup the parser held back)."""
    delta: dict = {}
    if choice.text is not None:
        delta["content"] = choice.text
    if choice.reasoning:
        delta["reasoning"] = choice.reasoning
    if choice.tool_calls:
        delta["tool_calls"] = [_tool_call_piece(piece) for piece in choice.tool_calls]
    content = _logprob_content(choice)
    if not delta and content is None and choice.finish_reason is None and choice.token_ids is None:
        return None  # with token ids asked for, sent all the same: every token is in some chunk, as on vLLM's server
    logprobs = None if content is None else {"content": content}
    entry = {"index": choice.index, "delta": delta, "finish_reason": choice.finish_reason, "logprobs": logprobs}
    if choice.token_ids is not None:
        entry["token_ids"] = choice.token_ids
    if choice.finish_reason is not None:
        entry["stop_reason"] = choice.stop_reason
    return entry


def _tool_call_piece(piece: ToolCallDelta) -> dict:
    """OpenAI's streamed shape: id, type and name on a call's first piece only."""
    body: dict = {"index": piece.index}
    if piece.id:
        body.update(id=piece.id, type="function")
    function = {"arguments": piece.arguments}
    if piece.name:
        function["name"] = piece.name
    body["function"] = function
    return body


def chunk(request_id: str, model: str, created: int, choices: list[dict], **extra) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    body.update(extra)
    return body


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
