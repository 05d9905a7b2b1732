"""OpenAI's `usage` as the gateway builds it from the engine's deltas (gateway/api/responses.py)."""

from __future__ import annotations

from gateway.api import responses
from protocol.to_gateway import ChoiceDelta, TokenDelta


def delta(*choices: ChoiceDelta) -> TokenDelta:
    return TokenDelta("r", list(choices), completion_tokens=9, prompt_tokens=20, cached_tokens=16)


def test_usage_carries_vllm_s_prefix_cache_hits_and_prism_s_visual_tokens():
    body = responses.usage(delta(ChoiceDelta(0, "a", tokens=9)), image_tokens=12)
    assert body == {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29,
                    "prompt_tokens_details": {"cached_tokens": 16, "image_tokens": 12}}  # no completion_tokens_details


def test_reasoning_tokens_are_each_choice_s_latest_count_and_their_sum_in_the_total():
    """As vLLM's server reports them with a reasoning parser: a chunk's usage counts its own
    choice, the final usage all of them."""
    counts = responses.ReasoningCounts()
    assert (counts.of(0), counts.total()) == (None, None)  # the engine counts none: no reasoning parser
    counts.add(delta(ChoiceDelta(0, reasoning_tokens=3), ChoiceDelta(1, reasoning_tokens=1)))
    counts.add(delta(ChoiceDelta(1, "b")))  # a delta that counts nothing leaves the count
    counts.add(delta(ChoiceDelta(0, reasoning_tokens=5)))
    assert (counts.of(0), counts.of(1), counts.of(2), counts.total()) == (5, 1, 0, 6)
    body = responses.usage(delta(), image_tokens=0, reasoning_tokens=counts.total())
    assert body["completion_tokens_details"] == {"reasoning_tokens": 6}
