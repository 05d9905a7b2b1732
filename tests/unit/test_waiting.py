"""The tests' wait on a state (tests/waiting.py): it returns once the state
holds, and past its timeout fails naming what it waited for and what it last saw."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.waiting import wait_until, wait_until_async


def test_returns_once_the_state_holds():
    counts = itertools.count()
    wait_until(lambda: next(counts) >= 3, 10, "three polls", every_s=0)
    assert next(counts) == 4  # polled until it held (counts 0-3), and no more


def test_a_timeout_names_what_was_awaited_and_the_last_value_seen():
    with pytest.raises(AssertionError, match=r"not within 0.01 s: the queue empty \(last seen: \[1, 2\]\)"):
        wait_until(lambda: False, 0.01, "the queue empty", every_s=0.001, observe=lambda: [1, 2])
    with pytest.raises(AssertionError, match=r"last seen: ''"):
        wait_until(lambda: "", 0.01, "a name", every_s=0.001)  # no observe: the predicate's own value


def test_the_async_wait_takes_coroutine_predicates_and_lets_the_loop_run():
    async def scenario():
        ticks = []
        ticking = asyncio.get_running_loop().call_soon(ticks.append, 1)

        async def ticked():
            return ticks

        await wait_until_async(ticked, 10, "the loop ran a callback")
        ticking.cancel()
        with pytest.raises(AssertionError, match=r"the impossible \(last seen: 'still no'\)"):
            await wait_until_async(lambda: False, 0.01, "the impossible", observe=ticked_text)

    async def ticked_text():
        return "still no"

    asyncio.run(scenario())
