"""The engine's reading of a chat request: what it refuses before vLLM sees it."""

from __future__ import annotations

import msgspec
import pytest

from llm_engine.prompts import InvalidPrompt
from llm_engine.requests import Parsing, check_tool_choice, read_chat
from common.config import ConfigError
from prism.demo_model import CHAT_TEMPLATE

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HERMES = Parsing(parser_cls=object, tool_parser="hermes", reasoning_parser=None)
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def chat(**fields):
    return read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **fields}))


def test_tools_with_a_template_that_cannot_show_them_are_refused():
    with pytest.raises(InvalidPrompt, match="chat template does not render tools"):
        check_tool_choice(chat(tools=[TOOL]), HERMES, PLAIN_TEMPLATE)
    check_tool_choice(chat(tools=[TOOL]), HERMES, CHAT_TEMPLATE)  # the demo's renders them


def test_tools_without_a_parser_are_refused_naming_the_key():
    with pytest.raises(InvalidPrompt, match="engine.tool_call_parser"):
        check_tool_choice(chat(tools=[TOOL]), Parsing(None, None, None), CHAT_TEMPLATE)


def test_tool_choice_none_needs_neither():
    check_tool_choice(chat(tools=[TOOL], tool_choice="none"), Parsing(None, None, None), PLAIN_TEMPLATE)


def test_vllm_s_own_request_checks_are_the_request_s_fault():
    with pytest.raises(InvalidPrompt, match="top_logprobs"):
        chat(top_logprobs=3)  # without logprobs: refused by vLLM's ChatCompletionRequest


def test_an_unknown_parser_name_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="engine.tool_call_parser"):
        Parsing.create("no-such-parser", None, tokenizer=None, model="m")
