"""The engine's reading of a chat request: what it refuses before vLLM sees it."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from llm_engine.prompts import InvalidPrompt, template_messages
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


def test_a_parser_whose_package_is_not_installed_is_a_config_error_naming_it():
    from transformers import AutoTokenizer

    from prism.tiny_models import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("qwen2-thinking"))
    with pytest.raises(ConfigError, match="engine.reasoning_parser: The Cohere Command parser requires the `cohere_melody` package"):
        Parsing.create(None, "cohere_command3", tokenizer, model="m")


STRICT_TOOL = {"type": "function", "function": {**TOOL["function"], "strict": True}}


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_a_strict_tool_under_auto_is_refused_where_vllm_cannot_hold_the_call_to_its_schema(tool_choice):
    asked = chat(tools=[TOOL, STRICT_TOOL], **({"tool_choice": tool_choice} if tool_choice else {}))
    with pytest.raises(InvalidPrompt, match=r"tools\[1\]\.function\.strict"):
        check_tool_choice(asked, HERMES, CHAT_TEMPLATE)
    check_tool_choice(asked, dataclasses.replace(HERMES, strict_auto_calls=True), CHAT_TEMPLATE)


def test_a_strict_tool_is_taken_where_the_call_is_forced_by_a_schema():
    check_tool_choice(chat(tools=[STRICT_TOOL], tool_choice="required"), HERMES, CHAT_TEMPLATE)
    check_tool_choice(chat(tools=[STRICT_TOOL], tool_choice={"type": "function", "function": {"name": "f"}}), HERMES, CHAT_TEMPLATE)


@pytest.mark.parametrize("strict_tool_calling,expected", [(True, True), (False, False)])
def test_auto_calls_are_held_to_a_schema_only_with_vllm_s_structural_tags(strict_tool_calling, expected):
    parsing = Parsing.create("hermes", None, tokenizer=None, model="m", strict_tool_calling=strict_tool_calling)
    assert parsing.strict_auto_calls is expected  # hermes has a structural tag model; the setting decides


def test_an_answer_s_reasoning_reaches_the_template_under_both_of_vllm_s_names():
    messages = read_chat(msgspec.json.encode({"messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "two and two"},
        {"role": "user", "content": "sure?"}]})).messages
    rendered = template_messages(messages)
    assert rendered[1]["reasoning"] == rendered[1]["reasoning_content"] == "two and two"
    assert "reasoning" not in rendered[0] and "reasoning" not in rendered[2]


def test_an_answer_s_refusal_part_reaches_the_template_as_text_as_vllm_renders_it():
    from vllm.renderers.chat_utils import MM_PARSER_MAP, TEXT_PART_TYPES

    part = {"type": "refusal", "refusal": "I can't help with that."}
    messages = read_chat(msgspec.json.encode({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [part]}, {"role": "user", "content": "why?"}]})).messages
    assert "refusal" in TEXT_PART_TYPES  # vLLM's: a refusal part is the text it carries
    assert template_messages(messages)[1]["content"] == [{"type": "text", "text": MM_PARSER_MAP["refusal"](part)}]


def test_a_strict_tool_under_auto_with_an_output_constraint_the_tags_cannot_carry_is_refused():
    tagged = dataclasses.replace(HERMES, strict_auto_calls=True)
    check_tool_choice(chat(tools=[STRICT_TOOL], structured_outputs={"regex": "[ab]+"}), tagged, CHAT_TEMPLATE)
    with pytest.raises(InvalidPrompt, match=r"tools\[0\]\.function\.strict: .*xgrammar compiles"):
        check_tool_choice(chat(tools=[STRICT_TOOL], structured_outputs={"regex": "(?=a)a"}), tagged, CHAT_TEMPLATE)  # a lookahead


def test_a_reasoning_parser_holds_structured_outputs_until_the_reasoning_ends():
    """vLLM's server tells its engine where the reasoning ends (the grammar applies after it) and
    names the reasoning parser in its structured-output config: without them a reasoning model's
    JSON was held from its first token, so it could not think, and its answer was filed as reasoning."""
    from transformers import AutoTokenizer

    from llm_engine.config import EngineConfig
    from llm_engine.requests import Read
    from llm_engine.service import engine_args
    from common.families import FAMILIES
    from prism.demo_model import RANDOM_MODEL, ensure_demo_model

    args = engine_args(EngineConfig(model="/models/qwen3", reasoning_parser="qwen3"), FAMILIES[0])
    assert args.create_structured_outputs_config().reasoning_parser == "qwen3"

    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_model(RANDOM_MODEL))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    parsing = Parsing.create(None, "qwen3", tokenizer, "demo")
    request = chat(response_format={"type": "json_object"})
    read = Read(request, None, {"enable_thinking": False}, parsing.for_request(request, tokenizer, None, {}), lambda: None)
    thought = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    thinking = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert read.reasoning(thought) == {"reasoning_ended": True, "reasoning_parser_kwargs": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert read.reasoning(thinking)["reasoning_ended"] is False
    plain = Read(request, None, {}, None, lambda: None)
    assert plain.reasoning(thinking) == {"reasoning_ended": None, "reasoning_parser_kwargs": None}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "f"}}], ids=["required", "named"])
def test_an_output_format_beside_a_forced_call_is_refused_not_dropped(tool_choice):
    """vLLM's parser replaces the format with the call's schema without a word."""
    with pytest.raises(InvalidPrompt, match="an output format cannot apply to it"):
        check_tool_choice(chat(tools=[TOOL], tool_choice=tool_choice, response_format={"type": "json_object"}), HERMES, CHAT_TEMPLATE)
    check_tool_choice(chat(tools=[TOOL], tool_choice=tool_choice), HERMES, CHAT_TEMPLATE)


THINKING_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                     "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}")
EFFORT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if reasoning_effort %}({{ reasoning_effort }}){% endif %}"


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    from prism.demo_model import RANDOM_MODEL, ensure_demo_model

    return AutoTokenizer.from_pretrained(ensure_demo_model(RANDOM_MODEL))


@pytest.mark.parametrize("template,fields,changes_the_prompt", [
    (THINKING_TEMPLATE, {"reasoning_effort": "none"}, True),
    (THINKING_TEMPLATE, {"reasoning_effort": "high"}, False),  # thinking is that template's default
    (EFFORT_TEMPLATE, {"reasoning_effort": "high"}, True),
    (EFFORT_TEMPLATE, {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, True),  # the field wins
], ids=["switch-off", "switch-on", "degree", "degree-set"])
def test_reasoning_effort_reaches_the_template_as_vllm_s_server_passes_it(demo_tokenizer, template, fields, changes_the_prompt):
    from llm_engine.requests import template_kwargs

    request = chat(**fields)
    vllm_s = request.build_chat_params(template, "string").chat_template_kwargs
    ours = template_kwargs(request, demo_tokenizer, template)
    assert ours == {k: v for k, v in vllm_s.items() if k not in ("add_generation_prompt", "continue_final_message")}

    def rendered(**kwargs) -> str:
        return demo_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template, tokenize=False, **kwargs)

    assert (rendered(**ours) != rendered()) is changes_the_prompt


@pytest.mark.parametrize("template,fields,why", [
    (PLAIN_TEMPLATE, {"reasoning_effort": "low"}, "this model's chat template has no reasoning switch"),
    (THINKING_TEMPLATE, {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "send one of the two"),
], ids=["no-switch", "switch-set"])
def test_a_reasoning_effort_that_would_change_nothing_is_refused(demo_tokenizer, template, fields, why):
    """vLLM's server drops it; the client expected it to change the answer."""
    from llm_engine.requests import template_kwargs

    with pytest.raises(InvalidPrompt, match=f"reasoning_effort: .*{why}.*the effort would change nothing") as refused:
        template_kwargs(chat(**fields), demo_tokenizer, template)
    assert refused.value.param == "reasoning_effort"


def test_hiding_the_reasoning_needs_a_reasoning_parser():
    from llm_engine.requests import check_reasoning_shown

    check_reasoning_shown(chat(include_reasoning=False), dataclasses.replace(HERMES, reasoning_parser="qwen3"))
    check_reasoning_shown(chat(), HERMES)
    with pytest.raises(InvalidPrompt, match="include_reasoning: this engine has no reasoning parser"):
        check_reasoning_shown(chat(include_reasoning=False), HERMES)


def test_a_priority_is_refused_where_the_engine_serves_first_come_first_served():
    from llm_engine.requests import check_priority

    check_priority(chat(priority=-2), "priority")
    check_priority(chat(), "fcfs")
    with pytest.raises(InvalidPrompt, match=r"priority: .*engine.scheduling_policy: fcfs") as refused:
        check_priority(chat(priority=1), "fcfs")
    assert refused.value.param == "priority"


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_engine_s_scheduling_policy_is_vllm_s(policy):
    from llm_engine.config import EngineConfig
    from llm_engine.service import engine_args
    from common.families import FAMILIES

    args = engine_args(EngineConfig(model="/models/m", scheduling_policy=policy), FAMILIES[0])
    assert args.scheduling_policy == policy


@pytest.mark.parametrize("fields,prompt_logprobs", [
    ({"echo": True}, None),  # vLLM's server: 0, and the whole prompt prefilled again past the prefix cache
    ({"echo": True, "stream": True, "logprobs": True, "top_logprobs": 3}, None),  # a stream sends none
    ({"echo": True, "logprobs": True, "top_logprobs": 3}, 3),  # as vLLM's server
    ({"prompt_logprobs": 2}, 2),
], ids=["echo", "streamed-echo", "echo-with-logprobs", "asked"])
def test_prompt_logprobs_are_computed_where_they_are_sent(fields, prompt_logprobs):
    from llm_engine.requests import sampling_params

    params = sampling_params(chat(**fields), 8, {})
    assert params.prompt_logprobs == prompt_logprobs
    assert params.skip_reading_prefix_cache is (prompt_logprobs is not None)


def test_prompt_logprobs_past_the_engine_s_limit_are_refused_naming_the_field_that_asked():
    from llm_engine.requests import check_prompt_logprobs, sampling_params

    for fields, field in (({"prompt_logprobs": 0}, "prompt_logprobs"), ({"echo": True, "logprobs": True}, "echo")):
        request = chat(**fields)
        check_prompt_logprobs(request, sampling_params(request, 8, {}), 4096, 4096)
        with pytest.raises(InvalidPrompt, match=r"at most 4096 tokens \(engine.max_prompt_logprobs_tokens.*this one has 4097") as refused:
            check_prompt_logprobs(request, sampling_params(request, 8, {}), 4097, 4096)
        assert refused.value.param == field
    check_prompt_logprobs(chat(echo=True), sampling_params(chat(echo=True), 8, {}), 10**6, 4096)  # none computed


def test_a_stream_interval_batches_a_stream_only_as_on_vllm_s_server():
    """The engine streams every answer to the gateway; a whole answer's is not held to it (vLLM's server ignores it)."""
    from llm_engine.requests import sampling_params

    def interval(**fields) -> int | None:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream_interval": 8, **fields}
        return sampling_params(read_chat(msgspec.json.encode(body)), 16, {}).stream_interval

    assert interval(stream=True) == 8 and interval() is None
