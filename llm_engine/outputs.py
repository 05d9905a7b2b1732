"""vLLM's per-choice outputs → the wire's ChoiceDelta: content, logprobs in the
chat shape, and tool calls parsed out by vLLM's own Parser.

Streamed requests go through `parse_delta` as vLLM's server streams them;
non-streamed ones send token counts as they come (the gateway times them)
and the parsed message once, from `parse` over the whole text, as vLLM's
server answers them. OpenAI's finish reason for a call: "tool_calls" unless
the function was named by `tool_choice` ("stop").
"""

from __future__ import annotations

import math

from protocol.to_gateway import ChoiceDelta, PromptLogprob, TokenLogprob, ToolCallDelta, TopLogprob

LOGPROB_FLOOR = -9999.0  # vLLM's server clamps -inf to this (JSON has no infinity)


class GenerationError(RuntimeError):
    """vLLM ended a choice with finish_reason "error" (e.g. its grammar refused
    the tokens sampled): a server error (500), as vLLM's server answers it
    (`_raise_if_error`), never a finished answer."""


class ParserError(RuntimeError):
    """vLLM's tool or reasoning parser failed on the model's output: the server's fault
    (a 500), not the request's (its ValueErrors would read as a 400)."""


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _logprob(value: float) -> float:
    """Within JSON: -inf (and a NaN from a broken step) at vLLM's floor."""
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def chat_logprobs(token_ids, step_logprobs, top: int, tokenizer, as_ids: bool = False) -> list[TokenLogprob]:
    """vLLM's server's `_create_chat_logprobs`: the sampled token first in each
    step's dict, the first `top` entries (in vLLM's order) as top_logprobs.
    `as_ids` (vLLM's return_tokens_as_token_ids): each token named "token_id:<id>",
    a sampled one's bytes still its text's, as vLLM's server gives them."""

    def decoded(logprob, token_id: int) -> str:
        return logprob.decoded_token if logprob.decoded_token is not None else tokenizer.decode([token_id])

    def named(logprob, token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else decoded(logprob, token_id)

    out = []
    for token_id, step in zip(token_ids, step_logprobs):
        sampled = step.get(token_id) if step else None
        if sampled is None:
            token = f"token_id:{token_id}" if as_ids else tokenizer.decode(token_id)
            out.append(TokenLogprob(token, LOGPROB_FLOOR, _bytes(token)))
            continue
        tops = [
            TopLogprob(text := named(lp, tid), _logprob(lp.logprob), _bytes(text))
            for i, (tid, lp) in enumerate(step.items()) if top == -1 or i < top
        ]
        text = decoded(sampled, token_id)
        out.append(TokenLogprob(named(sampled, token_id), _logprob(sampled.logprob), _bytes(text), tops))
    return out


def prompt_logprobs(positions) -> list[list[PromptLogprob] | None] | None:
    """vLLM's RequestOutput.prompt_logprobs for the wire, -inf at vLLM's floor (`clamp_prompt_logprobs`)."""
    if positions is None:
        return None
    return [None if at is None else [PromptLogprob(token_id, _logprob(lp.logprob), lp.rank, lp.decoded_token)
                                     for token_id, lp in at.items()] for at in positions]


def tool_call_deltas(calls, parallel: bool) -> list[ToolCallDelta]:
    """vLLM's DeltaToolCall list → wire pieces (`parallel_tool_calls: false`: the first call only)."""
    pieces = [
        ToolCallDelta(call.index, call.id or "", (call.function.name or "") if call.function else "",
                      (call.function.arguments or "") if call.function else "")
        for call in calls
    ]
    return pieces if parallel else [p for p in pieces if p.index == 0]


class ChoiceStream:
    """One choice of one request: turns each of its vLLM outputs into a delta."""

    def __init__(self, index: int, chat, parser, tokenizer, prompt_token_ids, empty_steps: bool = False) -> None:
        self.index = index
        self.chat = chat
        self.parser = parser  # vLLM's Parser, or None (plain text)
        # A step whose text is empty (a character's first bytes, text held for a stop string) as vLLM's
        # server streams it: `content: ""` where it runs no parser; held back by a tool parser it runs on
        # every request (Prism runs none on a request without tools).
        self.empty_steps = empty_steps
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.text: list[str] = []  # non-streamed with a parser: parsed once at the end
        self.token_ids: list[int] = []  # with a parser: a non-streamed parse and the reasoning count read them
        # vLLM's server reports `completion_tokens_details.reasoning_tokens` when it has a reasoning
        # parser: counted once at the end, or at every step when the stream's usage is continuous.
        self.counts_reasoning = getattr(parser, "reasoning_parser", None) is not None
        options = getattr(chat, "stream_options", None)
        self.continuous_usage = bool(chat.stream and options and options.include_usage and options.continuous_usage_stats)
        self.called_tools = False
        self.named = chat.tool_choice is not None and not isinstance(chat.tool_choice, str)

    def delta(self, output) -> ChoiceDelta:
        if output.finish_reason == "error":
            raise GenerationError(f"vLLM ended choice {self.index} with an internal error; retry the request")
        finished = output.finish_reason is not None
        if self.parser is not None:
            self.token_ids.extend(output.token_ids)
        logprobs = None
        if self.chat.logprobs:
            top = -1 if self.chat.logprob_token_ids else self.chat.top_logprobs  # vLLM's server gives every chosen id
            logprobs = chat_logprobs(output.token_ids, output.logprobs or [], top, self.tokenizer,
                                     bool(self.chat.return_tokens_as_token_ids))
        fields = self._parsed(output, finished)
        if fields.get("tool_calls"):
            self.called_tools = True
        reason = self._finish_reason(output.finish_reason) if finished else None
        return ChoiceDelta(self.index, finish_reason=reason, logprobs=logprobs, tokens=len(output.token_ids),
                           stop_reason=output.stop_reason if finished else None,
                           reasoning_tokens=self._reasoning_tokens(finished),
                           token_ids=list(output.token_ids) if self.chat.return_token_ids else None, **fields)

    def _reasoning_tokens(self, finished: bool) -> int | None:
        if not self.counts_reasoning or not (finished or self.continuous_usage):
            return None
        try:
            return self.parser.count_reasoning_tokens(tuple(self.token_ids))
        except Exception as exc:
            raise ParserError(f"the reasoning parser failed to count choice {self.index}'s tokens: {exc!r}") from exc

    def _parsed(self, output, finished: bool) -> dict:
        if self.parser is None:
            return {"text": output.text} if output.text or (self.empty_steps and output.token_ids) else {}
        try:
            return self._parsed_by_parser(output, finished)
        except Exception as exc:
            raise ParserError(f"the output parser failed on choice {self.index}: {exc!r}") from exc

    def _parsed_by_parser(self, output, finished: bool) -> dict:
        if self.chat.stream:
            message = self.parser.parse_delta(
                delta_text=output.text, delta_token_ids=list(output.token_ids), request=self.chat,
                prompt_token_ids=self.prompt_token_ids, finished=finished,
            )
            return self._message_fields(message.content, message.reasoning, message.tool_calls) if message else {}
        self.text.append(output.text)
        if not finished:
            return {}
        if self.prompt_token_ids is not None:  # a parser that reads the prompt's end (vLLM's `hf`) sees it, as on vLLM's server
            self.parser.set_prompt_token_ids(self.prompt_token_ids)
        reasoning, content, calls = self.parser.parse(
            "".join(self.text), self.chat, enable_auto_tools=True, model_output_token_ids=self.token_ids,
        )
        as_deltas = [_indexed(i, call) for i, call in enumerate(calls or [])]
        # `include_reasoning: false` leaves it out of the answer at the gateway, which reads from it that the
        # content is null (cut off while reasoning); a streamed delta's is dropped by vLLM's parser itself.
        return self._message_fields(content, reasoning, as_deltas)

    def _message_fields(self, content, reasoning, calls) -> dict:
        fields = {"text": content, "reasoning": reasoning or ""}
        if calls:
            fields["tool_calls"] = tool_call_deltas(calls, self.chat.parallel_tool_calls is not False)
        return fields

    def _finish_reason(self, reason: str) -> str:
        """vLLM's server's: "tool_calls" once a call was made, except for a function named by
        tool_choice ("stop"); a non-streamed answer in auto mode says so even when cut off."""
        if not self.called_tools or self.named:
            return reason
        if reason == "stop" or (not self.chat.stream and self.chat.tool_choice in (None, "auto")):
            return "tool_calls"
        return reason


def _indexed(index: int, call):
    """A whole parsed call (FunctionCall, or a ToolCall's function) as one delta."""
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaToolCall
    from vllm.renderers.chat_utils import make_tool_call_id

    function = getattr(call, "function", call)
    call_id = getattr(call, "id", None) or make_tool_call_id()
    return DeltaToolCall(index=index, id=call_id, type="function",
                         function=DeltaFunctionCall(name=function.name, arguments=function.arguments))
