"""One choice's vLLM outputs as the wire's deltas (llm_engine/outputs.py), on vLLM's own output type."""

from __future__ import annotations

import msgspec
import pytest
from vllm.outputs import CompletionOutput

from llm_engine.outputs import ChoiceStream, GenerationError
from llm_engine.requests import read_chat


def output(text: str, finish_reason: str | None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=[7], cumulative_logprob=None, logprobs=None, finish_reason=finish_reason)


def plain_choice(empty_steps: bool = False) -> ChoiceStream:
    chat = read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}]}))
    return ChoiceStream(0, chat, parser=None, tokenizer=None, prompt_token_ids=[1, 2], empty_steps=empty_steps)


@pytest.mark.parametrize("empty_steps,texts", [(True, ["", "", "é"]), (False, [None, None, "é"])],
                         ids=["no-parser-configured", "tool-parser-configured"])
def test_a_token_that_makes_no_text_yet_is_a_step_of_empty_content_where_vllm_s_server_streams_one(empty_steps, texts):
    """vLLM's server streams `content: ""` for such a step where it runs no parser (tests/integration/
    test_api_parity.py checks the other case: its tool parser, run on every request, holds the step back)."""
    choice = plain_choice(empty_steps)
    assert [choice.delta(output(text, None)).text for text in ("", "", "é")] == texts
    nothing_made = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason=None)
    assert choice.delta(nothing_made).text is None  # as vLLM's server skips a step of no token (a chunked prefill's)


def test_the_gateway_streams_empty_content_where_the_engine_made_some_and_no_chunk_where_it_made_none():
    from gateway.api.responses import stream_choice
    from protocol.to_gateway import ChoiceDelta

    assert stream_choice(ChoiceDelta(0, "", tokens=1))["delta"] == {"content": ""}
    assert stream_choice(ChoiceDelta(0, tokens=1)) is None
    assert stream_choice(ChoiceDelta(0, finish_reason="stop", tokens=1))["delta"] == {}


def test_a_choice_ends_with_vllm_s_finish_reason():
    choice = plain_choice()
    assert choice.delta(output("a", None)).finish_reason is None
    assert choice.delta(output("b", "length")).finish_reason == "length"


def test_a_choice_vllm_ended_in_error_is_a_server_error_not_an_answer():
    """vLLM's server answers finish_reason "error" with a 500 (a stream: an error event), never as a finished reply."""
    choice = plain_choice()
    choice.delta(output("a", None))
    with pytest.raises(GenerationError, match="internal error"):
        choice.delta(output("b", "error"))


class PromptReadingParser:
    """A parser whose answer depends on the prompt it was given, as vLLM's `hf` response-template
    parser's does (a prompt that ends inside <think> makes the answer's start reasoning)."""

    def __init__(self) -> None:
        self.prompt: list[int] | None = None

    def set_prompt_token_ids(self, prompt_token_ids) -> None:
        self.prompt = list(prompt_token_ids)

    def parse(self, text, request, enable_auto_tools, model_output_token_ids):
        return (text, "", None) if self.prompt == [1, 2] else (None, text, None)


def test_a_non_streamed_answer_is_parsed_knowing_its_prompt_as_vllm_s_server_parses_it():
    chat = read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}]}))
    choice = ChoiceStream(0, chat, parser=PromptReadingParser(), tokenizer=None, prompt_token_ids=[1, 2])
    choice.delta(output("thinking ", None))
    last = choice.delta(output("on", "stop"))
    assert (last.reasoning, last.text) == ("thinking on", "")


class BrokenParser:
    """A parser that fails on the model's output (a JSON error inside a tool call)."""

    def parse_delta(self, **_):
        raise ValueError("Expecting value: line 1 column 1 (char 0)")


def test_a_parser_failing_on_the_output_is_the_server_s_error_not_the_request_s():
    """Its ValueError, let through, read as the request's fault: a 400 before any token."""
    from llm_engine.outputs import ParserError

    chat = read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], "stream": True}))
    choice = ChoiceStream(0, chat, parser=BrokenParser(), tokenizer=None, prompt_token_ids=[1, 2])
    with pytest.raises(ParserError, match="Expecting value") as caught:
        choice.delta(output("{", None))
    assert not isinstance(caught.value, ValueError)


def test_a_logprob_json_cannot_carry_is_vllm_s_floor():
    from llm_engine.outputs import LOGPROB_FLOOR, _logprob

    assert [_logprob(x) for x in (float("nan"), float("-inf"), -1.5)] == [LOGPROB_FLOOR, LOGPROB_FLOOR, -1.5]


@pytest.fixture(scope="module")
def thinking_tokenizer():
    """The demo tokenizer with Qwen3's <think> markers, which vLLM's qwen3 reasoning parser looks up."""
    from transformers import AutoTokenizer

    from common.config import REPO_ROOT

    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "models" / "prism-shapes")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tokenizer


def reasoning_choice(tokenizer, reasoning_parser: str | None, **request) -> ChoiceStream:
    from llm_engine.requests import Parsing

    chat = read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **request}))
    parser = Parsing.create(None, reasoning_parser, tokenizer, "prism-shapes").for_request(chat, tokenizer, None, {})
    return ChoiceStream(0, chat, parser=parser, tokenizer=tokenizer, prompt_token_ids=[1, 2])


def thought_and_answer(choice: ChoiceStream, tokenizer) -> list:
    """The deltas of <think> a b </think> c, one token per output."""
    think, done = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    steps = [([think], "<think>"), ([5], "a"), ([6], "b"), ([done], "</think>"), ([7], "c")]
    return [choice.delta(CompletionOutput(index=0, text=text, token_ids=ids, cumulative_logprob=None, logprobs=None,
                                          finish_reason="stop" if i == len(steps) - 1 else None))
            for i, (ids, text) in enumerate(steps)]


def reasoning_counts(choice: ChoiceStream, tokenizer) -> list[int | None]:
    """Each delta's reasoning count."""
    return [delta.reasoning_tokens for delta in thought_and_answer(choice, tokenizer)]


CONTINUOUS = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize("request_fields,counts", [
    ({}, [None, None, None, None, 2]),  # non-streamed: once, at the end
    ({"stream": True, "stream_options": {"include_usage": True}}, [None, None, None, None, 2]),
    (CONTINUOUS, [0, 1, 2, 2, 2]),  # vLLM's server: every chunk's usage counts them so far
], ids=["complete", "stream", "continuous"])
def test_reasoning_tokens_are_counted_by_vllm_s_reasoning_parser_when_vllm_s_server_would(thinking_tokenizer, request_fields, counts):
    assert reasoning_counts(reasoning_choice(thinking_tokenizer, "qwen3", **request_fields), thinking_tokenizer) == counts


def test_include_reasoning_false_leaves_the_reasoning_out_of_a_stream_the_reasoning_still_counted(thinking_tokenizer):
    """vLLM's parser drops it from the deltas; a non-streamed answer's is left out by the gateway
    (gateway/api/responses.py), which reads from it that a cut-off answer's content is null."""
    def answer(**fields) -> tuple[str, str, int]:
        deltas = thought_and_answer(reasoning_choice(thinking_tokenizer, "qwen3", **fields), thinking_tokenizer)
        return "".join(d.reasoning for d in deltas), "".join(d.text or "" for d in deltas), deltas[-1].reasoning_tokens

    assert answer(stream=True) == answer() == ("ab", "c", 2)
    assert answer(stream=True, include_reasoning=False) == ("", "c", 2)


@pytest.mark.parametrize("tool_parser,reasoning_parser,keeps", [
    (None, "qwen3", True), ("hermes", "qwen3", True), (None, "deepseek_r1", False), ("hermes", None, False), (None, None, False),
], ids=["qwen3", "hermes-and-qwen3", "deepseek-r1", "hermes-no-tools", "none"])
def test_whether_a_request_with_no_tools_keeps_its_special_tokens_is_vllm_s_parsers_word(
        thinking_tokenizer, tool_parser, reasoning_parser, keeps):
    """What the gateway is told (EngineReady.keeps_special_tokens) to judge `spaces_between_special_tokens`."""
    from llm_engine.requests import Parsing

    parsing = Parsing.create(tool_parser, reasoning_parser, thinking_tokenizer, "prism-shapes")
    assert parsing.keeps_special_tokens(thinking_tokenizer, None) is keeps


@pytest.mark.parametrize("reasoning_parser,budgets", [("qwen3", True), ("deepseek_r1", True), ("granite", False), ("deepseek_v3", False),
                                                       (None, False)])
def test_thinking_is_budgeted_where_vllm_s_reasoning_config_found_the_parser_s_markers(reasoning_parser, budgets):
    """As the engine reads it at start (llm_engine/service.py): vLLM's config, set up from engine.reasoning_parser."""
    from vllm.config import ModelConfig
    from vllm.config.reasoning import ReasoningConfig

    from llm_engine.requests import budgets_thinking
    from prism.tiny_models import ensure_tiny_model

    config = None
    if reasoning_parser is not None:
        config = ReasoningConfig(reasoning_parser=reasoning_parser)
        config.initialize_token_ids(ModelConfig(model=str(ensure_tiny_model("qwen2-thinking"))))
    assert budgets_thinking(config) is budgets


def test_a_reasoning_parser_without_an_end_marker_vllm_found_cannot_budget_thinking(thinking_tokenizer):
    from llm_engine.prompts import InvalidPrompt
    from llm_engine.requests import Parsing, check_thinking_budget

    chat = read_chat(b'{"messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": 8}')
    check_thinking_budget(chat, Parsing.create(None, "qwen3", thinking_tokenizer, "prism-shapes", budgets_thinking=True))
    with pytest.raises(InvalidPrompt, match="thinking_token_budget: this engine cannot end"):
        check_thinking_budget(chat, Parsing.create(None, "qwen3", thinking_tokenizer, "prism-shapes", budgets_thinking=False))


def test_without_a_reasoning_parser_no_reasoning_tokens_are_reported(thinking_tokenizer):
    assert reasoning_counts(reasoning_choice(thinking_tokenizer, None, **CONTINUOUS), thinking_tokenizer) == [None] * 5


def test_the_engine_reads_the_stream_s_usage_options_the_client_sent(thinking_tokenizer):
    """The gateway forwards them (vLLM's ChatCompletionRequest reads them), so the engine knows to count every step."""
    from gateway.api.pipeline import engine_chat
    from gateway.api.schemas import ChatCompletionRequest

    sent = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **CONTINUOUS})
    assert ChoiceStream(0, read_chat(engine_chat(sent)), None, thinking_tokenizer, [1]).continuous_usage


def test_logprob_tokens_named_by_their_ids_as_vllm_s_server_names_them():
    """`return_tokens_as_token_ids`: "token_id:<id>" everywhere; the sampled token's bytes stay its text's,
    a top entry's are its name's (vLLM's server's `_create_chat_logprobs` and `_get_top_logprobs`)."""
    from vllm.logprobs import Logprob

    from llm_engine.outputs import chat_logprobs

    class Tokenizer:
        def decode(self, ids):
            return {7: "red", 9: "blue"}[ids if isinstance(ids, int) else ids[0]]

    steps = [{7: Logprob(-0.5, 1, "red"), 9: Logprob(-1.5, 2, "blue")}, None]
    named = chat_logprobs([7, 9], steps, 2, Tokenizer(), as_ids=True)
    assert [(t.token, t.bytes) for t in named] == [("token_id:7", list(b"red")), ("token_id:9", list(b"token_id:9"))]
    assert [(t.token, t.bytes) for t in named[0].top_logprobs] == [("token_id:7", list(b"token_id:7")), ("token_id:9", list(b"token_id:9"))]
    plain = chat_logprobs([7, 9], steps, 2, Tokenizer())
    assert [t.token for t in plain] == ["red", "blue"] and [t.token for t in plain[0].top_logprobs] == ["red", "blue"]


def test_prompt_logprobs_travel_in_vllm_s_order_with_minus_infinity_at_its_floor():
    from vllm.logprobs import Logprob

    from llm_engine.outputs import LOGPROB_FLOOR, prompt_logprobs
    from protocol.to_gateway import PromptLogprob

    positions = [None, {9: Logprob(float("-inf"), 151000, "x"), 7: Logprob(-0.1, 1, "red")}]
    assert prompt_logprobs(positions) == [None, [PromptLogprob(9, LOGPROB_FLOOR, 151000, "x"), PromptLogprob(7, -0.1, 1, "red")]]
    assert prompt_logprobs(None) is None
