"""An admission ticket gives back everything its request held, exactly once."""

from __future__ import annotations

import pytest

from gateway.api.admission import ConcurrencyLimiter
from gateway.ops.workers import WorkerSlot
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
    other.on_release(lambda: left.append("late"))  # work that ends after its request did: given back at once
    assert left == ["model", "late"]


@pytest.mark.parametrize("limit,workers", [(2, 2), (7, 3), (16, 5), (3, 3)])
def test_worker_shares_add_up_to_the_configured_limit(limit, workers):
    shares = [WorkerSlot(i, workers).share(limit) for i in range(workers)]
    assert sum(shares) == limit and min(shares) >= 1 and max(shares) - min(shares) <= 1
    assert WorkerSlot(0, workers).share(None) is None


def test_a_worker_refuses_past_its_share_and_says_so():
    limiter = ConcurrencyLimiter.for_worker(5, None, 1000, WorkerSlot(1, 2))  # shares 3 and 2
    assert (limiter.limit, limiter.visual_token_limit) == (2, 500)
    limiter.admit("k")
    limiter.admit("k")
    with pytest.raises(APIError, match=r"limit of 2 concurrent requests \(this worker's share: the gateway runs 2 workers\)"):
        limiter.admit("k")
