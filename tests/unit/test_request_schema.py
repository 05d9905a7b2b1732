"""What the gateway's request schema takes that vLLM's server takes (gateway/api/schemas.py)."""

from __future__ import annotations

import msgspec
import pydantic
import pytest

from gateway.api.schemas import ChatCompletionRequest


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_reasoning_sent_back_under_its_older_name_is_the_reasoning():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "reasoning_content": "thought"},
               {"role": "user", "content": "more"}]
    assert request(messages=history).messages[1].reasoning == "thought"
    both = [{**history[1], "reasoning": "kept"}]
    assert request(messages=[history[0], *both]).messages[1].reasoning == "kept"


def test_a_repetition_penalty_vllm_takes_is_taken():
    assert request(repetition_penalty=2.5).repetition_penalty == 2.5


def test_an_answer_of_reasoning_alone_has_null_content_as_vllm_s():
    from gateway.api.responses import Answer
    from protocol.to_gateway import ChoiceDelta, TokenDelta

    answer = Answer()
    answer.add(TokenDelta("r", [ChoiceDelta(0, reasoning="hmm", finish_reason="length", tokens=1)], 1, 3, finished=True))
    answer.add(TokenDelta("r", [ChoiceDelta(1, text="", finish_reason="length", tokens=1)], 2, 3, finished=True))
    reasoned, empty = answer.choices()
    assert reasoned["message"] == {"role": "assistant", "content": None, "reasoning": "hmm"}
    assert empty["message"]["content"] == ""
    # ...and taken back as history, as vLLM's server takes it (the SDK's `reply.model_dump()`)
    history = [{"role": "user", "content": "hi"}, reasoned["message"], {"role": "user", "content": "go on"}]
    assert request(messages=history).messages[1].reasoning == "hmm"


def test_a_tool_call_without_its_type_is_refused_at_the_door_as_vllm_refuses_it():
    """Else it passed here and met vLLM's message types in the engine, after its images were encoded."""
    call = {"id": "a", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "a", "content": "done"}]
    with pytest.raises(pydantic.ValidationError, match=r"messages\.1\.tool_calls\.0\.type"):
        request(messages=history)
    history[1]["tool_calls"] = [{**call, "type": "function"}]
    assert request(messages=history).messages[1].tool_calls[0].type == "function"


def test_stream_options_without_stream_are_refused_unless_empty_as_vllm_refuses_them():
    assert request(stream_options={}).stream_options is not None  # vLLM's check reads `{}` as none given
    with pytest.raises(pydantic.ValidationError, match="stream_options needs stream: true"):
        request(stream_options={"include_usage": True})
    assert request(stream=True, stream_options={"include_usage": True}).stream_options.include_usage


def test_a_refusal_part_is_taken_in_an_assistant_message_only():
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}
    assert request(messages=[{"role": "user", "content": "hi"}, refused]).messages[1].content[0].refusal == "I can't help with that."
    with pytest.raises(pydantic.ValidationError, match="only assistant messages carry refusal parts"):
        request(messages=[{**refused, "role": "user"}])


def refused(body: dict | bytes) -> dict:
    """The error body a request gets at the gateway's door."""
    from gateway.api.parsing import validation_error

    with pytest.raises(pydantic.ValidationError) as caught:
        if isinstance(body, bytes):
            ChatCompletionRequest.model_validate_json(body)
        else:
            request(**body)
    return validation_error(caught.value).body()["error"]


@pytest.mark.parametrize("fields,param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"seed": 2**63}, "seed"),
    ({"temperature": 0, "n": 2}, "n"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": ["ok", ""]}, "bad_words.1"),
    ({"continue_final_message": True}, "continue_final_message"),  # beside the default add_generation_prompt
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"allowed_token_ids": [5, -1]}, "allowed_token_ids.1"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ({"include_reasoning": False, "logprobs": True}, "logprobs"),  # vLLM drops them: they would spell the reasoning out
    ({"include_reasoning": False, "return_token_ids": True}, "return_token_ids"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # answered whole only, as on vLLM's server
    ({"prompt_logprobs": 21}, "prompt_logprobs"),  # past vLLM's engine's max_logprobs
    ({"logprob_token_ids": [3, 5]}, "logprob_token_ids"),  # without logprobs: vLLM's server refuses it
    ({"logprobs": True, "top_logprobs": 2, "logprob_token_ids": [3]}, "logprob_token_ids"),  # vLLM drops top_logprobs
    ({"logprobs": True, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),  # past vLLM's sampler's rows
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 1}}, "repetition_detection"),
    ({"repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}}, "repetition_detection"),
    ({"stream": True, "stream_interval": 0}, "stream_interval"),
    ({"request_id": "job-7"}, "request_id"),  # X-Request-Id names the request here
    ({"truncation_side": "left"}, "truncation_side"),  # nothing to cut: vLLM's server ignores it
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"stream": True, "stream_interval": 1025}, "stream_interval"),  # a reply every 1024 tokens at most
    ({"repetition_detection": {"max_pattern_size": 1025, "min_count": 2}}, "repetition_detection.max_pattern_size"),
    ({"thinking_token_budget": -2}, "thinking_token_budget"),  # -1 is no budget
    ({"thinking_token_budget": True}, "thinking_token_budget"),  # vLLM's is strict: no bool, no 3.0
    ({"thinking_token_budget": 3.0}, "thinking_token_budget"),
], ids=["empty-tools", "auto-without-tools", "seed-past-64-bits", "greedy-n", "schema-missing", "json-object-false",
        "empty-grammar", "continuous-usage-alone", "min-over-max", "no-allowed-token", "empty-bad-word",
        "continue-and-open-a-turn", "unknown-effort", "negative-token-id", "two-efforts", "hidden-reasoning-logprobs",
        "hidden-reasoning-token-ids", "streamed-prompt-logprobs",
        "too-many-prompt-logprobs", "chosen-logprobs-alone", "chosen-beside-top-logprobs", "too-many-chosen-logprobs",
        "repetition-seen-once", "repetition-sizes-crossed", "no-tokens-a-chunk", "request-id-in-the-body",
        "side-without-a-cut", "cut-below-minus-one", "tokens-a-chunk-past-1024", "repetition-pattern-past-1024",
        "thinking-budget-below-minus-one", "thinking-budget-true", "thinking-budget-float"])
def test_what_vllm_would_refuse_after_the_images_are_encoded_is_refused_at_the_door_naming_the_field(fields, param):
    assert refused(fields)["param"] == param


@pytest.mark.parametrize("knob", ["disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"])
def test_structured_output_knobs_vllm_reads_only_from_its_config_are_refused(knob):
    error = refused({"structured_outputs": {"regex": "a+", knob: True if knob != "whitespace_pattern" else " "}})
    assert (error["param"], error["code"]) == (f"structured_outputs.{knob}", "unsupported_parameter")
    default = None if knob == "whitespace_pattern" else False  # asks for nothing: taken, and not forwarded
    assert request(structured_outputs={"regex": "a+", knob: default}).structured_outputs.regex == "a+"


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_numbers_that_are_not_finite_are_refused_wherever_they_are(number):
    head = b'{"model":"m","messages":[{"role":"user","content":"hi"}],'
    assert refused(head + b'"repetition_penalty":' + number + b"}")["param"] == "repetition_penalty"
    schema = head + b'"structured_outputs":{"json":{"type":"number","maximum":' + number + b"}}}"
    assert refused(schema)["param"] == "structured_outputs.json.maximum"


def test_a_body_that_is_not_an_object_is_a_400_naming_no_field():
    error = refused(b"[]")
    assert error["param"] is None and error["message"].startswith("invalid request body")


def test_what_vllm_s_server_takes_past_openai_s_limits_is_taken():
    """vLLM's server serves these (OpenAI's API refuses some): an application moving from vLLM keeps working."""
    many = request(stop=[f"s{i}" for i in range(8)], logit_bias={str(i): 150 for i in range(400)},
                   stop_token_ids=list(range(100)), tools=[{"type": "function", "function": {"name": f"tool.{i}"}} for i in range(130)],
                   response_format={"type": "json_schema", "json_schema": {"name": "github.issue", "schema": {}}})
    assert len(many.stop) == 8 and many.logit_bias[0] == 150  # held to [-100, 100] by vLLM, as on its server
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "done"}]
    assert request(messages=history).messages[2].tool_call_id is None
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]}).model is None


@pytest.mark.parametrize("field,value", [("top_k", 2**63), ("stop_token_ids", [2**64]), ("logit_bias", {str(10**25): 1}),
                                         ("max_tokens", 2**64), ("max_completion_tokens", 2**64), ("min_tokens", 2**64),
                                         ("seed", -2**63 - 1)])
def test_integers_vllm_s_engine_core_cannot_carry_are_refused_at_the_door(field, value):
    """Past 64 bits msgpack (vLLM's engine core's wire) cannot carry them: vLLM failed after the images' encode."""
    from gateway.api.parsing import validation_error

    with pytest.raises(pydantic.ValidationError) as raised:
        request(**{field: value})
    assert validation_error(raised.value).param.startswith(field)


@pytest.mark.parametrize("body,param", [({"Temperature": 0.2}, "Temperature"),
                                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "Schema": {}}}},
                                         "response_format.json_schema.Schema")])
def test_an_unknown_field_of_capitals_is_named_as_sent(body, param):
    from gateway.api.parsing import validation_error

    with pytest.raises(pydantic.ValidationError) as raised:
        request(**body)
    error = validation_error(raised.value)
    assert (error.param, error.code) == (param, "unsupported_parameter"), error.message


def test_an_integer_past_64_bits_anywhere_in_the_body_is_refused_naming_where():
    """Inside a schema, a tool's parameters: msgpack (vLLM's engine core's wire) cannot carry it."""
    schema = {"type": "integer", "maximum": 10**30}
    with pytest.raises(pydantic.ValidationError, match="64 bits"):
        request(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    with pytest.raises(pydantic.ValidationError, match="64 bits"):
        request(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": schema}}}}])
    assert request(seed=2**63 - 1).seed == 2**63 - 1


def test_max_tokens_beside_a_different_max_completion_tokens_is_refused_not_ignored():
    """vLLM would take max_completion_tokens and quietly ignore max_tokens: a limit the client set
    that does nothing. The same number in both (some clients send both) is one limit."""
    error = refused({"max_tokens": 5, "max_completion_tokens": 50})
    assert error["param"] == "max_tokens" and "differ" in error["message"]
    assert request(max_tokens=7, max_completion_tokens=7).max_completion_tokens == 7


@pytest.mark.parametrize("header,expected", [(None, 4), ("-7", -7), (" 2 ", 2)])
def test_vllm_s_priority_header_sets_the_priority_over_the_body_s(header, expected):
    from gateway.api.parsing import with_header_priority
    from gateway.api.pipeline import engine_chat

    prioritised = with_header_priority(request(priority=4), header)
    assert prioritised.priority == expected
    assert msgspec.json.decode(engine_chat(prioritised))["priority"] == expected  # forwarded: set, not a default


@pytest.mark.parametrize("header", ["high", "", str(2**63)])
def test_a_priority_header_that_is_no_64_bit_integer_is_refused(header):
    from gateway.api.parsing import with_header_priority
    from gateway.errors import APIError

    with pytest.raises(APIError, match="X-Vllm-Priority: .* is not a 64-bit integer") as refused:
        with_header_priority(request(), header)
    assert refused.value.status == 400 and refused.value.param == "priority"


CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize("final", [
    {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
    {"role": "user", "content": [{"type": "text", "text": "What is"}, IMAGE]},
    {"role": "user", "content": [IMAGE]},
], ids=["tool-calls", "image-after-the-text", "no-text"])
def test_continuing_a_final_message_whose_end_is_not_its_text_is_refused(final):
    """The prompt is cut where the message's last text ends: what follows would be left out, saying nothing."""
    error = refused({"messages": [{"role": "user", "content": "hi"}, final], "continue_final_message": True,
                     "add_generation_prompt": False})
    assert error["param"] == "continue_final_message"


def test_the_answer_s_role_is_the_final_message_s_where_no_new_turn_opens_as_on_vllm_s_server():
    from gateway.api.responses import AnswerShape

    assert request().response_role == "assistant"
    assert request(add_generation_prompt=False).response_role == "user"
    begun = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    continued = request(messages=begun, add_generation_prompt=False, continue_final_message=True)
    assert AnswerShape.of(continued) == AnswerShape(False, "assistant", True)


def test_hidden_reasoning_leaves_a_cut_off_answer_s_content_null_as_vllm_s():
    from gateway.api.responses import Answer, AnswerShape
    from protocol.to_gateway import ChoiceDelta, TokenDelta

    def body(shape: AnswerShape) -> dict:
        answer = Answer(shape)
        answer.add(TokenDelta("r", [ChoiceDelta(0, reasoning="hmm", finish_reason="length", tokens=1)], 1, 3, finished=True))
        return answer.choices()[0]["message"]

    assert body(AnswerShape()) == {"role": "assistant", "content": None, "reasoning": "hmm"}
    assert body(AnswerShape(shows_reasoning=False)) == {"role": "assistant", "content": None}
    assert body(AnswerShape(role="user", shows_reasoning=False))["role"] == "user"


@pytest.mark.parametrize("part,param", [
    ({"type": "text", "text": "hi", "colour": "red"}, "messages.0.content.0.colour"),
    ({"type": "image_url", "image_url": {"url": "data:,"}, "colour": "red"}, "messages.0.content.0.colour"),
    ({"type": "image_url", "image_url": {"url": "data:,", "colour": "red"}}, "messages.0.content.0.image_url.colour"),
], ids=["beside-text", "beside-an-image", "inside-an-image"])
def test_an_unknown_key_of_a_content_part_is_named_where_it_was_sent(part, param):
    """Not under the part's tag, which pydantic puts in the location ('content.0.image_url.colour')."""
    assert refused({"messages": [{"role": "user", "content": [part]}]})["param"] == param


def test_a_message_field_named_as_a_part_s_tag_is_named_as_sent():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "refusal": "no", "text": "y"}]
    assert refused({"messages": history})["param"] in ("messages.1.refusal", "messages.1.text")


def test_echo_repeats_the_final_message_s_text_where_it_is_in_the_answer_s_role_as_vllm_s_server():
    begun = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    continued = {"messages": begun, "add_generation_prompt": False, "continue_final_message": True}
    assert request(echo=True, **continued).echoed == "Hello\nthere"
    assert request(**continued).echoed is None
    assert request(echo=True).echoed == ""  # a user's message, and the answer is the assistant's: nothing, as vLLM's
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    error = refused({"messages": [{"role": "user", "content": [image, {"type": "text", "text": "A"}]}], "echo": True,
                     "add_generation_prompt": False})
    assert error["param"] == "echo"


def test_an_empty_list_of_token_ids_for_logprobs_is_unset_as_vllm_reads_it():
    assert request(logprobs=True, top_logprobs=2, logprob_token_ids=[]).logprob_token_ids is None
