"""Waiting in a test for a state, never for a fixed time: poll what is waited
for until it holds, and past the timeout fail naming it and what was last
seen. The timeout only keeps a broken build from hanging; it is no speed
target. Light on imports: unit and integration tests both use it."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.1,
               observe: Callable[[], object] | None = None) -> float:
    """Seconds until `predicate()` holds (is truthy). Past `timeout_s` the test
    fails naming `what` and the last value seen: `observe()`'s if given (for a
    predicate that only answers yes or no), else the predicate's own."""
    started = time.monotonic()
    while not (last := predicate()):
        if time.monotonic() - started > timeout_s:
            raise AssertionError(timed_out(timeout_s, what, observe() if observe else last))
        time.sleep(every_s)
    return time.monotonic() - started


async def wait_until_async(predicate: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.01,
                           observe: Callable[[], object] | None = None) -> float:
    """`wait_until` inside an event loop, which keeps running meanwhile;
    `predicate` and `observe` may be coroutine functions."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not (last := await value_of(predicate)):
        if loop.time() - started > timeout_s:
            raise AssertionError(timed_out(timeout_s, what, await value_of(observe) if observe else last))
        await asyncio.sleep(every_s)
    return loop.time() - started


async def value_of(read: Callable[[], object]) -> object:
    value = read()
    return await value if inspect.isawaitable(value) else value


def timed_out(timeout_s: float, what: str, last: object) -> str:
    return f"not within {timeout_s} s: {what} (last seen: {last!r})"
