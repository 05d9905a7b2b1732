"""An admission ticket gives back everything its request held, exactly once."""

from __future__ import annotations

import pytest

from gateway.admission import ConcurrencyLimiter
from gateway.errors import APIError


def test_a_ticket_holds_its_slot_and_visual_tokens_until_released_once():
    limiter = ConcurrencyLimiter(limit=2, per_key_limit=1, visual_token_limit=100)
    left = []
    ticket = limiter.admit("key-a")
    ticket.on_release(lambda: left.append("model"))
    ticket.reserve_visual_tokens(60)
    with pytest.raises(APIError, match="this API key is at its limit of 1"):
        limiter.admit("key-a")
    other = limiter.admit("key-b")
    with pytest.raises(APIError, match="budget of 100 visual tokens") as refused:
        other.reserve_visual_tokens(41)
    assert refused.value.status == 429 and other.visual_tokens == 0
    with pytest.raises(APIError, match="limit of 2 concurrent requests"):
        limiter.admit("key-c")
    ticket.release()
    ticket.release()  # a second path ending the same request gives nothing back twice
    assert (limiter.in_flight, limiter.visual_tokens, dict(limiter.per_key), left) == (1, 0, {"key-b": 1}, ["model"])
    other.reserve_visual_tokens(100)
    other.release()
    assert (limiter.in_flight, limiter.visual_tokens, dict(limiter.per_key)) == (0, 0, {})
