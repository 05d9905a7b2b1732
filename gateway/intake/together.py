"""A request's intake steps run side by side (its images' fetches, decodes), and
the work they hand to the intake threads."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from gateway.errors import APIError
from gateway.intake.stops import Stopped

T = TypeVar("T")
log = logging.getLogger("prism.gateway")


async def all_or_none(*steps: Awaitable[Any]) -> list[Any]:
    """Every step's result, in order, as `asyncio.gather` gives them; but the first failure
    cancels the other steps, and waits for them to end, before it is raised. `gather` leaves
    them running: a request refused for one bad image kept fetching its others, holding their
    share of the memory budget, long after its answer had gone."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await outlast(*tasks)
        raise


async def outlast(*futures: asyncio.Future) -> None:
    """Until every future has ended, however often the waiting task is cancelled meanwhile
    (the caller raises its own error after): a step still ending holds memory the request
    counts, and a second cancel must not let the request give it back first. Their
    exceptions are retrieved, as a request's that has ended: a refusal or a stop is
    expected then, anything else is logged here (nobody else will see it)."""
    while not all(future.done() for future in futures):
        try:
            await asyncio.wait(futures)
        except asyncio.CancelledError:
            continue
    for future in futures:
        if not future.cancelled() and (error := future.exception()) is not None and not _expected(error):
            log.error("a step of a request that ended failed", exc_info=error)


def _expected(error: BaseException) -> bool:
    """How a step of an ended request ends: refused, told to stop, or cut short."""
    return isinstance(error, (APIError, Stopped, asyncio.CancelledError))


async def on_thread(pool: Executor, work: Callable[[Callable[[], bool]], T]) -> T:
    """`work(stop)` on one of the intake threads. Cancelled (the client left, another item of
    the request was refused), the work is told to stop (`stop()` turns True at once, so work
    still queued ends as it starts) and awaited: the threads are every request's, and what
    the work holds stays counted until it lets go."""
    ended = threading.Event()
    running = asyncio.get_running_loop().run_in_executor(pool, work, ended.is_set)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        ended.set()
        await outlast(running)
        raise
