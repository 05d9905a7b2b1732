"""What the gateway's request schema takes that vLLM's server takes (gateway/api/schemas.py)."""

from __future__ import annotations

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
