"""A request's intake steps side by side: one failure ends the others before it is raised."""

from __future__ import annotations

import asyncio

import pytest

from gateway.intake.together import all_or_none


def test_the_results_come_in_order():
    async def step(value: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return value

    assert asyncio.run(all_or_none(step(1, 0.02), step(2, 0.0), step(3, 0.01))) == [1, 2, 3]


def test_the_first_failure_cancels_the_other_steps_before_it_is_raised():
    ended: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)  # a slow image server
        finally:
            ended.append("slow")  # its memory hold is given back here

    async def refused() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("HTTP 404")

    async def run() -> None:
        with pytest.raises(ValueError, match="404"):
            await all_or_none(slow(), refused(), slow())
        assert ended == ["slow", "slow"]  # ended before the refusal reached the caller

    asyncio.run(asyncio.wait_for(run(), 5))
