"""What an http(s) image's fetch counts against the gateway's memory budget (gateway/intake/fetch.py),
against real local servers: nothing while the host has not answered, the size it declares while its
body comes, nothing once the fetch has ended (its bytes are then the request's to hold)."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.errors import APIError
from gateway.intake.fetch import FetchLimits, ImageFetcher
from gateway.intake.images import ImageLimits
from gateway.intake.memory import BODY_COPIES, MemoryBudget, MemoryHold, current_hold
from tests.waiting import wait_until_async

DECLARED = 300_000


async def server(handler) -> tuple[asyncio.AbstractServer, int]:
    started = await asyncio.start_server(handler, "127.0.0.1", 0)
    return started, started.sockets[0].getsockname()[1]


def sending_in_two(declared: int, rest: asyncio.Event, answer: asyncio.Event | None = None):
    """A host that answers (once `answer` is set, where given) declaring `declared` bytes, sends a
    thousand of them (all, if fewer), and the rest once `rest` is set."""
    first = min(1000, declared)

    async def handle(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer is not None:
            await answer.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % declared + b"x" * first)
        await writer.drain()
        await rest.wait()
        writer.write(b"x" * (declared - first))
        await writer.drain()
        writer.close()

    return handle


def counted_in(capacity: int, wait_s: float = 10) -> MemoryBudget:
    """A budget of `capacity`, the current request's: called inside the test's own run (asyncio.run's
    context), so no later test inherits it."""
    budget = MemoryBudget(wait_s=wait_s)
    budget.size(capacity)
    current_hold.set(MemoryHold(budget))
    return budget


def local_fetcher(max_bytes: int = 2**20, total_timeout_s: float = 20) -> ImageFetcher:
    return ImageFetcher(FetchLimits(2, 10, total_timeout_s, 0, allowed_networks=("127.0.0.0/8",)),
                        ImageLimits(max_bytes, 10**8, 2, 200))


@contextlib.asynccontextmanager
async def peak_working(budget: MemoryBudget):
    """[the most `budget.working` was while the block ran], looked at every millisecond."""
    peak = [0]

    async def watch() -> None:
        while True:
            peak[0] = max(peak[0], budget.working)
            await asyncio.sleep(0.001)

    watching = asyncio.create_task(watch())
    try:
        yield peak
    finally:
        watching.cancel()


async def fetch_counts() -> tuple[int, int, int]:
    """(counted while the host says nothing, while its declared body trickles, once it is read)."""
    budget, fetcher = counted_in(2**30), local_fetcher()
    answer, body_sent = asyncio.Event(), asyncio.Event()

    host, port = await server(sending_in_two(DECLARED, body_sent, answer))
    try:
        fetching = asyncio.create_task(fetcher.fetch(f"http://127.0.0.1:{port}/a.png", "img"))
        await asyncio.sleep(0.3)  # connected, the request sent: the host says nothing yet
        silent = budget.working
        answer.set()
        await wait_until_async(lambda: budget.working > 0, 5, "the response counted")
        trickling = budget.working
        body_sent.set()
        assert len(await fetching) == DECLARED
        return silent, trickling, budget.working
    finally:
        host.close()
        await fetcher.close()


def test_a_fetch_counts_what_its_response_declares_while_it_comes_and_nothing_before():
    assert asyncio.run(fetch_counts()) == (0, BODY_COPIES * DECLARED, 0)


async def chunked_peak() -> tuple[int, int]:
    """(the most counted while a chunked body that also says Content-Length: 1 came, its bytes)."""
    budget, fetcher = counted_in(2**30), local_fetcher()

    async def chunked_host(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(30):  # 30 chunks of 10 KB: the chunking, not the length, ends the body
            writer.write(b"2710\r\n" + b"x" * 10_000 + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    host, port = await server(chunked_host)
    try:
        async with peak_working(budget) as peak:
            body = await fetcher.fetch(f"http://127.0.0.1:{port}/a.png", "img")
        return peak[0], len(body)
    finally:
        host.close()
        await fetcher.close()


def test_a_chunked_body_is_counted_at_the_cap_whatever_length_it_declares():
    """h11 ends a chunked body where its chunks end, past a Content-Length it also sends: counted by
    that length, 300 KB came under a reservation of 2 bytes."""
    assert asyncio.run(chunked_peak()) == (BODY_COPIES * 2**20, 300_000)


async def refusal(fetcher: ImageFetcher, handler) -> APIError:
    """What a fetch from a host answering with `handler` is refused with."""
    host, port = await server(handler)
    try:
        await fetcher.fetch(f"http://127.0.0.1:{port}/a.png", "img")
    except APIError as refused:
        return refused
    finally:
        host.close()
        await fetcher.close()
    raise AssertionError("fetched, where a refusal was due")


async def full_budget_refusal() -> tuple[int, str]:
    """A fetch whose response waits for room longer than the fetch's whole deadline: what it gets."""
    budget, fetcher = counted_in(1000, wait_s=1.0), local_fetcher(total_timeout_s=0.5)
    budget.working = 1000  # full: every fetch waits for room
    refused = await refusal(fetcher, sending_in_two(10, asyncio.Event()))
    return refused.status, refused.code


def test_a_fetch_waiting_for_memory_is_refused_as_memory_full_not_as_a_fetch_timeout():
    """The wait for room is the budget's (memory_wait_s, then 503 + Retry-After), not the host's time."""
    assert asyncio.run(full_budget_refusal()) == (503, "memory_full")


def test_a_declared_body_past_the_whole_budget_is_a_413_before_it_is_read():
    async def fetch_large() -> APIError:
        counted_in(10 * 2**20)
        return await refusal(local_fetcher(64 * 2**20), sending_in_two(8 * 2**20, asyncio.Event()))

    refused = asyncio.run(fetch_large())
    assert refused.status == 413 and "more than its whole budget" in refused.message


def test_two_fetches_that_each_fit_the_budget_alone_both_come_one_after_the_other():
    """A fetch reserves all it may take at once, or waits holding nothing: two that fit one at a
    time never each hold a part while waiting on the other (both would be 503s at memory_wait_s)."""
    declared = 12 * 2**20

    async def two_at_once() -> list[int]:
        counted_in(3 * declared, wait_s=5)  # room for one body and its copy at a time
        fetcher = local_fetcher(64 * 2**20)
        sent = asyncio.Event()
        sent.set()
        host, port = await server(sending_in_two(declared, sent))
        try:
            bodies = await asyncio.gather(*(fetcher.fetch(f"http://127.0.0.1:{port}/{n}.png", "img") for n in range(2)))
            return [len(body) for body in bodies]
        finally:
            host.close()
            await fetcher.close()

    assert asyncio.run(two_at_once()) == [declared, declared]
