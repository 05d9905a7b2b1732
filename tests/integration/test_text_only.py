"""A language model without a vision part is served text-only: no encoder
runs, text requests are answered, and a request with an image gets a 400
naming the model before any image is fetched. Configured with encoders
anyway, `prism serve` stops at once and says why.

The model is a thinking one, as Qwen3's text checkpoints are (its answers open
inside <think>), served as they are, with vLLM's qwen3 reasoning parser and
hermes tool parser: the reasoning comes apart from the answer and is counted,
`thinking_token_budget` ends it, and a JSON schema or a forced call holds what
follows it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from gateway.config import GatewayConfig
from prism.launch import service_children
from testing.stack import LocalStack
from prism.tiny_models import ensure_tiny_model
from protocol.to_gateway import GenerateFailed
from tests.integration.conftest import ONE_PROCESS_ENGINE, STACK_OVERRIDES
from tests.integration.helpers import embeddings_request, send_raw

ENGINE_ONLY = {k: v for k, v in STACK_OVERRIDES.items() if not k.startswith("PRISM_ENCODER__")} | ONE_PROCESS_ENGINE
# As Qwen3's are served: vLLM's qwen3 reasoning parser, and hermes for its tool calls.
THINKING = {"PRISM_ENGINE__REASONING_PARSER": "qwen3", "PRISM_ENGINE__TOOL_CALL_PARSER": "hermes"}


@pytest.fixture(scope="module")
def text_stack(tmp_path_factory):
    checkpoint = ensure_tiny_model("qwen2-thinking")
    with LocalStack(tmp_path_factory.mktemp("text-only"), ENGINE_ONLY | THINKING, model=checkpoint, encoder_replicas=0) as stack:
        yield stack, OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_is_answered_with_no_encoder_running(text_stack):
    stack, client = text_stack
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
    ready = httpx.get(f"{stack.base_url}/health/ready").json()
    assert ready["status"] == "ready" and [m["encoder"] for m in ready["models"].values()] == ["none"]


def test_an_image_gets_a_400_naming_the_model(text_stack):
    stack, client = text_stack
    name = client.models.list().data[0].id
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}  # never fetched
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}],
                                       max_tokens=5)
    error = caught.value.body
    assert error["code"] == "images_not_supported" and error["param"] == "messages[0].content[0]"
    assert f"model '{name}' is served text-only" in error["message"]


def test_the_engine_refuses_embeddings_sent_to_it_directly(text_stack):
    stack, _ = text_stack
    reply = asyncio.run(send_raw(stack.engine_addresses[0], *embeddings_request("no-images", torch.randn(4, 128), None)))
    assert isinstance(reply, GenerateFailed) and reply.status == 400 and "text-only" in reply.message


def test_prism_serve_refuses_encoders_for_a_text_only_model():
    checkpoint = str(ensure_tiny_model("qwen2-text"))
    config = GatewayConfig(models={"chat": {"encoder_addresses": ["ipc:///tmp/x.sock"], "engine_addresses": ["ipc:///tmp/y.sock"],
                                            "checkpoint": checkpoint}})
    with pytest.raises(SystemExit, match="text-only: list no encoder addresses"):
        service_children(config, None, checkpoint)


@dataclass(frozen=True)
class Thought:
    reasoning: str | None
    content: str | None
    reasoning_tokens: int
    tokens: list[str]  # every sampled token, </think> included


def think(client: OpenAI, **fields) -> Thought:
    """A greedy answer of 10 tokens; `fields` go in the body as they are (extra_body)."""
    logprobs = fields.get("include_reasoning", True)  # beside hidden reasoning, a 400: they would spell it out
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=10, temperature=0, logprobs=logprobs, extra_body=fields)
    choice = answer.choices[0]
    tokens = [entry.token for entry in choice.logprobs.content] if logprobs else []
    return Thought(choice.message.model_extra.get("reasoning"), choice.message.content,
                   answer.usage.completion_tokens_details.reasoning_tokens, tokens)


def test_a_thinking_model_s_reasoning_comes_apart_from_its_answer_and_is_counted(text_stack):
    _, client = text_stack
    thought = think(client)  # cut off while reasoning: no answer yet
    assert thought.reasoning and thought.content is None and thought.reasoning_tokens == len(thought.tokens) == 10
    assert think(client, thinking_token_budget=-1) == thought  # -1: no budget
    hidden = think(client, include_reasoning=False)
    assert (hidden.reasoning, hidden.content, hidden.reasoning_tokens) == (None, None, 10)  # left out, still counted
    # vLLM's reasoning parser keeps special tokens in the text, so they can be spaced or not (none come here)
    assert think(client, spaces_between_special_tokens=False) == thought
    unthinking = think(client, chat_template_kwargs={"enable_thinking": False})  # the template closes <think> itself
    assert (unthinking.reasoning, unthinking.content, unthinking.reasoning_tokens) == (None, thought.reasoning, 0)


@pytest.mark.parametrize("budget", [0, 3])
def test_thinking_token_budget_ends_the_reasoning_where_vllm_counts_it(text_stack, budget):
    """The template's newline after <think> is the budget's first token, as vLLM counts the prompt's
    tokens inside a reasoning: `budget - 1` tokens of the model's own, the ones it writes with no
    budget, then vLLM's sampler writes </think> and the model answers."""
    _, client = text_stack
    free, budgeted = think(client), think(client, thinking_token_budget=budget)
    kept = max(budget - 1, 0)
    assert budgeted.tokens[:kept + 1] == [*free.tokens[:kept], "</think>"]
    assert budgeted.reasoning_tokens == kept and budgeted.content  # answered after it
    assert budgeted.reasoning == (free.reasoning[:len(budgeted.reasoning)] if kept else None)
    stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"thinking_token_budget": budget})
    chunks = list(stream)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    reasoning = "".join(delta.model_extra.get("reasoning") or "" for delta in deltas)
    assert (reasoning, "".join(delta.content or "" for delta in deltas)) == (budgeted.reasoning or "", budgeted.content)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == kept


def test_a_json_schema_holds_the_answer_after_a_budgeted_reasoning(text_stack):
    """vLLM's structured outputs leave the reasoning free and hold what follows </think>."""
    _, client = text_stack
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say hi."}], max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "count", "schema": schema, "strict": True}},
        extra_body={"thinking_token_budget": 3})
    message = answer.choices[0].message
    assert message.model_extra["reasoning"] == think(client, thinking_token_budget=3).reasoning
    assert isinstance(json.loads(message.content)["n"], int) and answer.choices[0].finish_reason == "stop"


def test_an_answer_cut_off_inside_its_hidden_reasoning_is_taken_back_as_history(text_stack):
    """Its content is null and it has no reasoning: vLLM renders it as an empty turn."""
    _, client = text_stack
    name, question = client.models.list().data[0].id, {"role": "user", "content": "Say hi."}
    reply = client.chat.completions.create(model=name, messages=[question], max_tokens=4, temperature=0,
                                           extra_body={"include_reasoning": False}).choices[0].message
    assert reply.content is None and "reasoning" not in reply.model_extra
    def prompt_tokens(*turns) -> int:
        answer = client.chat.completions.create(model=name, messages=[question, *turns, {"role": "user", "content": "More."}],
                                                max_tokens=2, temperature=0)
        assert answer.usage.completion_tokens == 2
        return answer.usage.prompt_tokens

    assert prompt_tokens(reply.model_dump()) == prompt_tokens({"role": "assistant", "content": ""}) > prompt_tokens()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"])
def test_a_forced_call_comes_after_a_budgeted_reasoning(text_stack, tool_choice):
    """vLLM holds the call's schema until the reasoning ends, as it holds a response_format: the
    reasoning is the one the model writes free to call or not (`auto`, the same prompt)."""
    _, client = text_stack
    zones = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"], "additionalProperties": False}}}
    fields = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say hi."}], max_tokens=120,
                  temperature=0, tools=[zones], tool_choice=tool_choice, extra_body={"thinking_token_budget": 3})
    answer = client.chat.completions.create(**fields).choices[0]
    reasoning = client.chat.completions.create(**(fields | {"tool_choice": "auto"})).choices[0].message.model_extra["reasoning"]
    assert answer.message.model_extra["reasoning"] == reasoning
    assert [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls] == [("get_time", {"zone": "UTC"})]
    deltas = [chunk.choices[0].delta for chunk in client.chat.completions.create(**fields, stream=True) if chunk.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
    streamed = "".join(call.function.arguments or "" for d in deltas for call in d.tool_calls or [])
    assert json.loads(streamed) == {"zone": "UTC"}
