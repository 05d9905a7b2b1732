"""A request's intake steps side by side: one failure ends the others before it is raised."""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.intake.together import all_or_none, on_thread
from tests.waiting import wait_until_async


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


def test_a_cancelled_request_ends_only_once_every_thread_it_started_has_ended():
    """The caller cancelled while the steps wait for their threads: all_or_none's own cancel of
    each step (a second one) must not let them give their memory back while the threads still
    run, and no step's error is left for the loop to log."""
    running, ran, loop_errors = set(), [], []
    release = threading.Event()

    def work(name: str, stop) -> str:
        running.add(name)
        ran.append(name)
        try:
            release.wait(5) if name == "first" else time.sleep(0.2)  # a decode that cannot be interrupted
            if name == "bad":
                raise ValueError("cannot decode")
            return name
        finally:
            running.discard(name)

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context["message"]))
        with ThreadPoolExecutor(2) as pool:
            steps = asyncio.ensure_future(all_or_none(*(on_thread(pool, functools.partial(work, name))
                                                         for name in ("first", "bad", "queued"))))
            await wait_until_async(lambda: running == {"first", "bad"}, 5, "two threads at work", observe=lambda: running)
            steps.cancel()
            threading.Timer(0.3, release.set).start()
            with pytest.raises(asyncio.CancelledError):
                await steps
            assert running == set()  # ended before the request did
            del steps
            gc.collect()
            await asyncio.sleep(0)

    asyncio.run(asyncio.wait_for(run(), 10))
    assert loop_errors == []


def test_work_still_queued_when_its_request_ends_is_told_to_stop_as_it_starts():
    started_with: list[bool] = []
    release = threading.Event()

    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            busy = asyncio.ensure_future(on_thread(pool, lambda stop: release.wait(5)))
            queued = asyncio.ensure_future(on_thread(pool, lambda stop: started_with.append(stop())))
            await asyncio.sleep(0.05)
            queued.cancel()
            for _ in range(2):  # the cancel reaches on_thread, which tells the work to stop
                await asyncio.sleep(0)
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await queued
            await busy

    asyncio.run(asyncio.wait_for(run(), 10))
    assert started_with == [True]
