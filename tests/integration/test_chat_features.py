"""Structured outputs, tools, logprobs, n and template switches through the
official openai client, on the random-weights demo model (its chat template
renders tools; vLLM's hermes parser reads the calls back).

A random model writes nothing valid by itself: every assertion below holds
only because the constraint or feature under test was applied."""

from __future__ import annotations

import json
import math
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.integration.chat_requests import COLOURS, QUESTION, SCENE_SCHEMA, TIME, WEATHER, image_part, loose
from tests.integration.conftest import MODEL_NAME


def create(client, **fields):
    fields.setdefault("messages", QUESTION)
    fields.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_NAME, **fields)


def test_json_schema_output_follows_the_schema(client, images):
    messages = [{"role": "user", "content": [image_part(images), {"type": "text", "text": "What is it?"}]}]
    response = create(client, messages=messages, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "scene", "schema": SCENE_SCHEMA, "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    answer = json.loads(choice.message.content)
    assert answer["colour"] in COLOURS and 0 <= answer["count"] <= 9 and set(answer) == {"colour", "count"}


class Scene(BaseModel):
    colour: Literal["red", "green", "blue", "yellow"]
    shapes: Literal[1, 2, 3]
    outdoors: bool


def test_the_sdk_parse_helper_gets_a_parsed_object(client, images):
    # The SDK turns the pydantic model into a strict json_schema response_format.
    messages = [{"role": "user", "content": [image_part(images), {"type": "text", "text": "What is it?"}]}]
    completion = client.chat.completions.parse(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0, response_format=Scene)
    scene = completion.choices[0].message.parsed
    assert isinstance(scene, Scene) and completion.choices[0].finish_reason == "stop"


def test_json_object_output_is_an_object(client):
    choice = create(client, max_tokens=200, response_format={"type": "json_object"}).choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("constraint,check", [
    ({"choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
], ids=["choice", "regex"])
def test_vllm_structured_outputs_extension(client, constraint, check):
    text = create(client, max_tokens=16, extra_body={"structured_outputs": constraint}).choices[0].message.content
    assert check(text), text


def test_logprobs_in_the_chat_shape(client):
    choice = create(client, max_tokens=6, logprobs=True, top_logprobs=5).choices[0]
    tokens = choice.logprobs.content
    assert len(tokens) == 6 and "".join(t.token for t in tokens) == choice.message.content
    for token in tokens:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert token.logprob == tops[0]  # greedy: the sampled token is the most likely one
        assert bytes(token.bytes).decode() == token.token
    assert sum(math.exp(t) for t in tops) <= 1.0 + 1e-6


def test_streamed_logprobs_match_the_non_streamed(client):
    plain = create(client, max_tokens=5, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    stream = create(client, max_tokens=5, logprobs=True, top_logprobs=2, stream=True)
    streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in plain]


def test_n_choices_with_a_seed_are_indexed_summed_and_repeatable(client):
    def sample():
        return create(client, max_tokens=6, n=3, seed=11, temperature=1.0)

    first, again = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1  # three samples, not one answer three times
    assert texts == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 18


def test_n_choices_stream_each_with_its_own_index(client):
    sampled = dict(max_tokens=4, n=2, seed=5, temperature=1.0)
    stream = create(client, stream=True, stream_options={"include_usage": True}, **sampled)
    text, finished, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert finished == {0: "length", 1: "length"}
    assert [text[0], text[1]] == [c.message.content for c in create(client, **sampled).choices]  # same seed, same samples
    assert usage.completion_tokens == 8


def test_n_above_one_needs_sampling(client):
    with pytest.raises(openai.BadRequestError, match="greedy"):  # vLLM's own check, as its server answers
        create(client, max_tokens=2, n=2)


def test_required_tool_choice_returns_a_valid_call(client):
    choice = create(client, max_tokens=120, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    assert arguments in ({"city": "Paris"}, {"city": "Rome"}, {"zone": "UTC"}, {"zone": "CET"})


def streamed_calls(stream) -> tuple[list[tuple[str, str, str]], str]:
    """([(id, name, arguments)] by call index, finish_reason), assembled from tool_calls deltas."""
    calls: dict[int, list[str]] = {}
    finish = ""
    for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, ["", "", ""])
                call[0], call[1] = call[0] or piece.id or "", call[1] or piece.function.name or ""
                call[2] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def streamed_call(stream) -> tuple[str, str, str, str]:
    """The one call a stream made: (id, name, arguments, finish_reason)."""
    calls, finish = streamed_calls(stream)
    assert len(calls) == 1, calls
    return (*calls[0], finish)


def test_a_streamed_tool_round_trip(client, images):
    # The call (forced by naming the function), the tool's result, then the answer.
    question = [{"role": "user", "content": [image_part(images), {"type": "text", "text": "Weather where this was taken?"}]}]
    stream = create(client, messages=question, max_tokens=120, tools=[WEATHER], stream=True,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call_id, name, arguments, finish = streamed_call(stream)
    assert call_id and name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")
    assert finish == "stop"  # OpenAI's finish reason for a named function
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 24 C"},
    ]
    answer = create(client, messages=history, max_tokens=8, tools=[loose(WEATHER)], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    assert text
    without_result = create(client, messages=history[:-1] + [{"role": "user", "content": "?"}], max_tokens=1, tools=[loose(WEATHER)])
    with_result = create(client, messages=history, max_tokens=1, tools=[loose(WEATHER)])
    assert with_result.usage.prompt_tokens > without_result.usage.prompt_tokens  # the result reached the prompt


def test_streamed_required_calls_assemble_to_the_non_streamed_ones(client):
    plain = create(client, max_tokens=120, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    calls, finish = streamed_calls(create(client, max_tokens=120, tools=[WEATHER, TIME], tool_choice="required", stream=True))
    assert [name for _, name, _ in calls] == [c.function.name for c in plain.message.tool_calls]
    assert [json.loads(args) for _, _, args in calls] == [json.loads(c.function.arguments) for c in plain.message.tool_calls]
    assert finish == plain.finish_reason


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    plain = create(client, max_tokens=120, tools=[WEATHER], tool_choice="required").choices[0]
    assert len(plain.message.tool_calls) > 1  # this model and prompt call several (else the test shows nothing)
    single = create(client, max_tokens=120, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in single.message.tool_calls] == [plain.message.tool_calls[0].function.name]
    calls, _ = streamed_calls(create(client, max_tokens=120, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=True))
    assert len(calls) == 1


def test_auto_tool_calls_are_parsed_out_of_the_text(client):
    # The hermes markup, forced by a regex: the parser must turn it into a call.
    markup = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
    for stream in (False, True):
        response = create(client, max_tokens=120, tools=[loose(WEATHER)], stream=stream, extra_body={"structured_outputs": {"regex": markup}})
        if stream:
            _, name, arguments, finish = streamed_call(response)
        else:
            message = response.choices[0].message
            assert not message.content and len(message.tool_calls) == 1
            name, arguments, finish = message.tool_calls[0].function.name, message.tool_calls[0].function.arguments, response.choices[0].finish_reason
        assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")
        assert finish == "tool_calls"


def test_tool_choice_none_leaves_the_markup_as_text(client):
    markup = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Rome"\}\}\n</tool_call>'
    message = create(client, max_tokens=120, tools=[WEATHER], tool_choice="none", extra_body={"structured_outputs": {"regex": markup}}).choices[0].message
    assert not message.tool_calls and message.content.startswith("<tool_call>")


def test_the_tools_reach_the_prompt(client):
    bare = create(client, max_tokens=1).usage.prompt_tokens
    assert create(client, max_tokens=1, tools=[loose(WEATHER)]).usage.prompt_tokens > bare


def test_chat_template_kwargs_change_the_prompt(client):
    bare = create(client, max_tokens=1).usage.prompt_tokens
    switched = create(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens
    assert switched > bare  # the demo template opens the answer with an empty <think></think>


def test_a_priority_for_an_engine_that_serves_in_arrival_order_is_refused_from_the_body_or_vllm_s_header(client, images):
    """The demo engine is vLLM's default, fcfs (tests/integration/test_replicas.py serves priorities)."""
    messages = [{"role": "user", "content": [image_part(images), {"type": "text", "text": "What is it?"}]}]
    for asking in (client.with_options(default_headers={"X-Vllm-Priority": "5"}), client):
        with pytest.raises(openai.BadRequestError, match=r"priority: .*\(engine.scheduling_policy: fcfs\)"):
            create(asking, messages=messages, max_tokens=1, extra_body={"priority": -3})
    assert create(client, messages=messages, max_tokens=1, extra_body={"priority": 0}).usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match="X-Vllm-Priority: 'soon' is not a 64-bit integer"):
        create(client.with_options(default_headers={"X-Vllm-Priority": "soon"}), max_tokens=1)


REFUSED = [
    ("unused-template-kwarg", {"chat_template_kwargs": {"no_such_switch": True}}, 400, "does not use no_such_switch"),
    ("reserved-template-kwarg", {"chat_template_kwargs": {"add_generation_prompt": False}}, 400, "add_generation_prompt"),
    ("top-logprobs-alone", {"top_logprobs": 3}, 400, "top_logprobs needs logprobs"),
    ("too-many-top-logprobs", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("n-over-limit", {"n": 9}, 400, "gateway.max_n"),
    ("unknown-named-tool", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "'nope', which is not among the tools"),
    ("required-without-tools", {"tool_choice": "required"}, 400, "needs tools"),
    ("two-constraints", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "exactly one of"),
    ("bad-response-format", {"response_format": {"type": "yaml"}}, 400, "response_format"),
    ("image-in-tool-result", {"messages": QUESTION + [{"role": "tool", "tool_call_id": "c", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "text only"),
    ("bad-schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "no-such-type"}}}}, 400, "no-such-type"),
    # The demo's engine.strict_tool_calling is off: `auto` calls are not held to the schema a strict tool asks for.
    ("strict-tool-under-auto", {"tools": [loose(TIME), WEATHER]}, 400, "tools[1].function.strict"),
]


@pytest.mark.parametrize("fields,status,needle", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_what_cannot_be_honoured_is_refused_naming_it(stack, fields, status, needle):
    body = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 2, **fields}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]
