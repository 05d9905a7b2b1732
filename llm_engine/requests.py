"""The client's chat request, read with vLLM's own OpenAI request model.

The gateway validated the request's shape and forwards it as JSON; here vLLM's
`ChatCompletionRequest` reads it, so sampling defaults and checks, structured
outputs (`response_format`, `structured_outputs`), tool choice and logprobs
mean exactly what they mean on vLLM's OpenAI server, through the same code:
`to_sampling_params`, and the tool/reasoning `Parser` that vLLM's
ParserManager composes (it constrains `tool_choice` required or named with a
structured-output schema, and parses tool calls out of the text).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llm_engine.prompts import InvalidPrompt


@dataclass(frozen=True)
class Parsing:
    """Which of vLLM's tool-call and reasoning parsers this engine runs."""

    parser_cls: type | None  # vLLM's composed Parser class; None: neither is configured
    tool_parser: str | None
    reasoning_parser: str | None
    # vLLM holds `tool_choice: auto` calls to a `strict` tool's schema only through its structural
    # tags: engine.strict_tool_calling on, and a tool parser that has one.
    strict_auto_calls: bool = False
    # vLLM's reasoning config found the reasoning parser's markers among the tokenizer's tokens, so
    # its sampler can end a reasoning at `thinking_token_budget` tokens.
    budgets_thinking: bool = False

    @classmethod
    def create(cls, tool_parser: str | None, reasoning_parser: str | None, tokenizer, model: str,
               strict_tool_calling: bool = True, budgets_thinking: bool = False) -> "Parsing":
        from vllm.parser.parser_manager import ParserManager

        from common.config import ConfigError

        try:
            parser_cls = ParserManager.get_parser(
                tool_parser_name=tool_parser, reasoning_parser_name=reasoning_parser,
                enable_auto_tools=tool_parser is not None, model_name=model, tokenizer=tokenizer,
            )
        except (KeyError, ValueError, TypeError, ImportError) as exc:  # ImportError: a parser needing a package not installed
            raise ConfigError(f"engine.tool_call_parser / engine.reasoning_parser: {exc}") from None
        tool_parser_cls = getattr(parser_cls, "tool_parser_cls", None)
        tagged = getattr(tool_parser_cls, "structural_tag_model", None) is not None
        return cls(parser_cls, tool_parser, reasoning_parser, strict_tool_calling and tagged, budgets_thinking)

    def keeps_special_tokens(self, tokenizer, model_config) -> bool:
        """Whether a request with no tools in play keeps its special tokens in the text: some of
        vLLM's reasoning parsers set `skip_special_tokens` false (`adjust_request`), others do not."""
        chat = read_chat(b'{"messages": [{"role": "user", "content": "hi"}]}')
        parser = self.for_request(chat, tokenizer, model_config, {})
        return parser is not None and not parser.adjust_request(chat).skip_special_tokens

    def for_request(self, chat, tokenizer, model_config, template_kwargs: dict):
        """A fresh parser (they are stateful: one per choice), or None when this
        request needs none: no tools in play and no reasoning parser."""
        if self.parser_cls is None or not (self.reasoning_parser or uses_tools(chat)):
            return None
        return self.parser_cls(tokenizer, chat.tools, model_config=model_config, chat_template_kwargs=template_kwargs)


@dataclass(frozen=True)
class Read:
    """One request as the engine reads it, before any tensor is fetched."""

    chat: Any  # vLLM's ChatCompletionRequest (adjusted by its parser: a forced call is a schema)
    template: Any  # llm_engine/templates.py's ChatTemplate
    template_kwargs: dict
    parser: Any  # vLLM's Parser for the request's first choice; None: it needs none
    new_parser: Callable[[], Any]  # one more (they are stateful: one per choice)

    def reasoning(self, prompt_token_ids: list[int]) -> dict:
        """generate()'s `reasoning_ended` and `reasoning_parser_kwargs`, as vLLM's server passes
        them: with a reasoning parser, structured outputs hold the answer after the reasoning
        (from the first token when the prompt already ended it, as `enable_thinking: false` does)."""
        reasoning_parser = getattr(self.parser, "reasoning_parser", None)
        return {
            "reasoning_ended": self.chat.resolve_reasoning_ended(self.parser, prompt_token_ids),
            "reasoning_parser_kwargs": None if reasoning_parser is None else {"chat_template_kwargs": self.template_kwargs},
        }


def uses_tools(chat) -> bool:
    return bool(chat.tools) and chat.tool_choice != "none"


def read_chat(raw: bytes):
    """vLLM's ChatCompletionRequest from the forwarded JSON; its own checks
    (e.g. `top_logprobs` without `logprobs`) become a 400 naming the field."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    try:
        chat = ChatCompletionRequest.model_validate_json(raw)
        for message in chat.messages:  # some of OpenAI's message types validate their parts lazily, once
            if message.get("content") is not None and not isinstance(message["content"], str):
                message["content"] = list(message["content"])
        return chat
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidPrompt(f"{where or 'request'}: {first['msg']}", where or None) from None
    except VLLMValidationError as exc:
        raise InvalidPrompt(str(exc), exc.parameter) from None


def check_tool_choice(chat, parsing: Parsing, template: str | None) -> None:
    """What vLLM's server refuses for tools, refused the same way, plus a chat
    template that cannot show the model its tools at all, and a `strict` tool
    whose `auto` calls nothing would hold to its schema."""
    if not uses_tools(chat):
        return
    if template is None or "tools" not in template:
        raise InvalidPrompt("tools: this model's chat template does not render tools, so the model cannot call them", "tools")
    if parsing.tool_parser is None:
        raise InvalidPrompt("tools: this engine has no tool-call parser (engine.tool_call_parser)", "tools")
    if chat.tool_choice != "auto" and chat.extract_structured_outputs() is not None:
        # vLLM's parser puts the call's own schema in their place and drops them, saying nothing.
        raise InvalidPrompt("response_format / structured_outputs: with tool_choice 'required' or a named tool the answer "
                            "is the call, held to the tool's schema; an output format cannot apply to it: send one or the other")
    strict = [i for i, tool in enumerate(chat.tools) if tool.function.strict]
    if chat.tool_choice != "auto" or not strict:
        return
    if not parsing.strict_auto_calls:
        raise InvalidPrompt(
            f"tools[{strict[0]}].function.strict: with tool_choice 'auto' this engine cannot hold a call's arguments "
            "to the tool's schema (it needs vLLM's structural tags: engine.strict_tool_calling and a tool parser "
            "that has them); send tool_choice 'required' or a named tool, which are held to it, or leave strict out",
            f"tools[{strict[0]}].function.strict")
    if (constraint := chat.extract_structured_outputs()) is not None and not _structural_tags_carry(constraint):
        raise InvalidPrompt(
            f"tools[{strict[0]}].function.strict: with tool_choice 'auto', vLLM's structural tags carry the output "
            "constraint only where xgrammar compiles it, and this one it does not: the call's arguments would not be "
            "held to the schema; drop the constraint or strict, or send tool_choice 'required' or a named tool",
            f"tools[{strict[0]}].function.strict")


def _structural_tags_carry(constraint) -> bool:
    """vLLM's own test (private: it drops the tool constraint for auto calls otherwise, with a warning)."""
    from vllm.parser.abstract_parser import _xgrammar_supports

    return _xgrammar_supports(constraint)


def sampling_params(chat, max_tokens: int, checkpoint_defaults: dict):
    """vLLM's own mapping (request value, else the checkpoint's
    generation_config.json default, else OpenAI's), as deltas: the engine
    always streams to the gateway, which assembles non-streamed answers."""
    from vllm.sampling_params import RequestOutputKind

    params = chat.to_sampling_params(max_tokens, checkpoint_defaults)
    params.output_kind = RequestOutputKind.DELTA
    if not chat.stream:
        params.stream_interval = None  # vLLM's server ignores it for a whole answer
    if chat.prompt_logprobs is None and chat.echo and (chat.stream or not chat.logprobs):
        # vLLM's server asks prompt logprobs for every echo, and with them prefills the whole prompt again,
        # past the prefix cache, even where it sends none (a stream): here only where logprobs are asked.
        params.prompt_logprobs = None
        params.skip_reading_prefix_cache = params.prompt_logprob_token_ids is not None
    return params


# Set by the engine itself; a client may not override them through the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "chat_template", "return_dict", "return_assistant_tokens_mask",
})


def template_kwargs(chat, tokenizer, template: str | None) -> dict:
    """`chat_template_kwargs` (e.g. Qwen3's `enable_thinking`), each checked
    against the variables the chat template uses (vLLM's
    resolve_chat_template_kwargs). vLLM's server drops a key the template does
    not use; here it is a 400, since the client expected it to change the prompt.
    `reasoning_effort` joins them as vLLM's server adds it (`_effort_kwargs`)."""
    asked = dict(chat.chat_template_kwargs or {})
    effort = _effort_kwargs(chat.reasoning_effort, asked)
    if not asked and not effort:
        return {}
    from vllm.renderers.hf import resolve_chat_template_kwargs

    if reserved := sorted(asked.keys() & RESERVED_TEMPLATE_KWARGS):
        raise InvalidPrompt(f"chat_template_kwargs: {', '.join(reserved)} cannot be set through the template's arguments", "chat_template_kwargs")
    accepted = resolve_chat_template_kwargs(tokenizer, template, asked | effort, raise_on_unexpected=False)
    if unused := sorted(asked.keys() - accepted.keys()):
        raise InvalidPrompt(f"chat_template_kwargs: this model's chat template does not use {', '.join(unused)}", "chat_template_kwargs")
    if effort and not effort.keys() & accepted.keys():
        why = ("the request's chat_template_kwargs.enable_thinking is this model's chat template's only reasoning switch: send one "
               "of the two" if "enable_thinking" in accepted else
               "this model's chat template has no reasoning switch (it uses neither reasoning_effort nor enable_thinking)")
        raise InvalidPrompt(f"reasoning_effort: {why}; the effort would change nothing", "reasoning_effort")
    return asked | effort  # what vLLM's server hands its parsers too: the template ignores what it does not use


def _effort_kwargs(effort: str | None, asked: dict) -> dict:
    """vLLM's server's (ChatCompletionRequest.build_chat_params): the effort itself, over the
    template argument of that name, and `enable_thinking` unless the client set it (off only
    for "none"), for the templates that switch reasoning on and off rather than by degree."""
    if effort is None:
        return {}
    return {"reasoning_effort": effort} | ({} if "enable_thinking" in asked else {"enable_thinking": effort != "none"})


def check_reasoning_shown(chat, parsing: Parsing) -> None:
    """`include_reasoning: false` hides what vLLM's reasoning parser finds: with none, the
    reasoning would reach the answer as text, so the request is refused instead."""
    if not chat.include_reasoning and parsing.reasoning_parser is None:
        raise InvalidPrompt("include_reasoning: this engine has no reasoning parser (engine.reasoning_parser), so it "
                            "cannot tell the model's reasoning from its answer to leave it out", "include_reasoning")


def budgets_thinking(reasoning_config) -> bool:
    """Whether vLLM's sampler can end a reasoning (`thinking_token_budget`): its reasoning config,
    set up from engine.reasoning_parser, found the parser's start and end markers among the tokens."""
    return reasoning_config is not None and reasoning_config.enabled


def check_thinking_budget(chat, parsing: Parsing) -> None:
    """vLLM's sampler ends the reasoning at `thinking_token_budget` tokens by the reasoning parser's
    markers: with no parser (or one without markers) the budget could not be kept, and vLLM would
    refuse it later. The gateway refuses it before the request's intake (EngineReady.budgets_thinking)."""
    if chat.thinking_token_budget is not None and not parsing.budgets_thinking:
        raise InvalidPrompt("thinking_token_budget: this engine cannot end a model's reasoning (it needs a reasoning parser "
                            "that marks where reasoning ends: engine.reasoning_parser)", "thinking_token_budget")


def check_special_token_spacing(chat) -> None:
    """`spaces_between_special_tokens: false` spaces nothing where special tokens are skipped. Read
    after the request's parser adjusted it: some of vLLM's parsers keep them in the text. The gateway
    refuses it before the request's intake where it can tell (protocol EngineReady.keeps_special_tokens)."""
    if not chat.spaces_between_special_tokens and chat.skip_special_tokens:
        raise InvalidPrompt("spaces_between_special_tokens: it only changes the text where special tokens are kept in it "
                            "(skip_special_tokens: false, or a parser of this engine's that keeps them: some reasoning parsers "
                            "do, e.g. vLLM's qwen3)", "spaces_between_special_tokens")


def check_priority(chat, scheduling_policy: str) -> None:
    """A priority an engine scheduling first come first served would ignore (vLLM's does, saying
    nothing). The gateway refuses it before the request's intake (gateway/api/pipeline.py); this is
    for a request that reached an engine whose policy changed since."""
    if chat.priority and scheduling_policy != "priority":
        raise InvalidPrompt(f"priority: this engine serves requests in arrival order (engine.scheduling_policy: "
                            f"{scheduling_policy}), so a priority would change nothing; send none, or run it with "
                            "scheduling_policy: priority", "priority")


def check_prompt_logprobs(chat, params, prompt_tokens: int, limit: int) -> None:
    """Prompt logprobs only for a prompt of at most `limit` tokens (engine.max_prompt_logprobs_tokens):
    vLLM computes their logits over the whole prompt in one step, all of them in memory at once."""
    if params.prompt_logprobs is not None and prompt_tokens > limit:
        field = "prompt_logprobs" if chat.prompt_logprobs is not None else "echo"
        raise InvalidPrompt(f"{field}: prompt logprobs are given for prompts of at most {limit} tokens "
                            f"(engine.max_prompt_logprobs_tokens: their logits take the engine's memory all at once); "
                            f"this one has {prompt_tokens}", field)
