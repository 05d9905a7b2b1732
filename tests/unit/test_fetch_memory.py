"""What an http(s) image's fetch counts against the gateway's memory budget (gateway/intake/fetch.py),
against real local servers: nothing while the host has not answered, the size it declares while its
body comes, nothing once the fetch has ended (its bytes are then the request's to hold)."""

from __future__ import annotations

import asyncio

from gateway.errors import APIError
from gateway.intake.fetch import FetchLimits, ImageFetcher
from gateway.intake.images import ImageLimits
from gateway.intake.memory import BODY_COPIES, MemoryBudget, MemoryHold, current_hold
from tests.waiting import wait_until_async

DECLARED = 300_000


async def server(handler) -> tuple[asyncio.AbstractServer, int]:
    started = await asyncio.start_server(handler, "127.0.0.1", 0)
    return started, started.sockets[0].getsockname()[1]


async def fetch_counts() -> tuple[int, int, int]:
    """(counted while the host says nothing, while its declared body trickles, once it is read)."""
    budget = MemoryBudget()
    budget.size(2**30)
    current_hold.set(MemoryHold(budget))
    fetcher = ImageFetcher(FetchLimits(2, 10, 20, 0, allowed_networks=("127.0.0.0/8",)), ImageLimits(2**20, 10**8, 2, 200))
    answer, body_sent = asyncio.Event(), asyncio.Event()

    async def slow_host(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await answer.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % DECLARED + b"x" * 1000)
        await writer.drain()
        await body_sent.wait()
        writer.write(b"x" * (DECLARED - 1000))
        await writer.drain()
        writer.close()

    host, port = await server(slow_host)
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
    budget = MemoryBudget()
    budget.size(2**30)
    current_hold.set(MemoryHold(budget))
    fetcher = ImageFetcher(FetchLimits(2, 10, 20, 0, allowed_networks=("127.0.0.0/8",)), ImageLimits(2**20, 10**8, 2, 200))
    peak = 0

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

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, budget.working)
            await asyncio.sleep(0.001)

    host, port = await server(chunked_host)
    watching = asyncio.create_task(watch())
    try:
        body = await fetcher.fetch(f"http://127.0.0.1:{port}/a.png", "img")
        return peak, len(body)
    finally:
        watching.cancel()
        host.close()
        await fetcher.close()


def test_a_chunked_body_is_counted_at_the_cap_whatever_length_it_declares():
    """h11 ends a chunked body where its chunks end, past a Content-Length it also sends: counted by
    that length, 300 KB came under a reservation of 2 bytes."""
    assert asyncio.run(chunked_peak()) == (BODY_COPIES * 2**20, 300_000)


async def full_budget_refusal() -> tuple[int, str]:
    """A fetch whose response waits for room longer than the fetch's whole deadline: what it gets."""
    budget = MemoryBudget(wait_s=1.0)
    budget.size(1000)
    budget.working = 1000  # full: every fetch waits for room
    current_hold.set(MemoryHold(budget))
    fetcher = ImageFetcher(FetchLimits(2, 10, 0.5, 0, allowed_networks=("127.0.0.0/8",)), ImageLimits(2**20, 10**8, 2, 200))

    async def host_handler(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789")
        await writer.drain()
        await asyncio.sleep(5)
        writer.close()

    host, port = await server(host_handler)
    try:
        await fetcher.fetch(f"http://127.0.0.1:{port}/a.png", "img")
    except APIError as refused:
        return refused.status, refused.code
    finally:
        host.close()
        await fetcher.close()
    raise AssertionError("fetched with no room")


def test_a_fetch_waiting_for_memory_is_refused_as_memory_full_not_as_a_fetch_timeout():
    """The wait for room is the budget's (memory_wait_s, then 503 + Retry-After), not the host's time."""
    assert asyncio.run(full_budget_refusal()) == (503, "memory_full")


async def trickled_then_sent(declared: int) -> tuple[int, int, int]:
    """(counted while a host that declared `declared` bytes trickles its first thousand, the most
    counted once it sends the rest, the bytes fetched)."""
    budget = MemoryBudget()
    budget.size(2**30)
    current_hold.set(MemoryHold(budget))
    fetcher = ImageFetcher(FetchLimits(2, 10, 20, 0, allowed_networks=("127.0.0.0/8",)), ImageLimits(64 * 2**20, 10**8, 2, 200))
    rest, peak = asyncio.Event(), 0

    async def trickling_host(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % declared + b"x" * 1000)
        await writer.drain()
        await rest.wait()
        writer.write(b"x" * (declared - 1000))
        await writer.drain()
        writer.close()

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, budget.working)
            await asyncio.sleep(0.001)

    host, port = await server(trickling_host)
    try:
        fetching = asyncio.create_task(fetcher.fetch(f"http://127.0.0.1:{port}/a.png", "img"))
        await wait_until_async(lambda: budget.working > 0, 5, "the first bytes counted")
        trickling = budget.working
        watching = asyncio.create_task(watch())
        rest.set()
        body = await fetching
        watching.cancel()
        return trickling, peak, len(body)
    finally:
        host.close()
        await fetcher.close()


def test_a_host_that_declares_a_large_body_and_trickles_it_holds_a_step_of_the_budget():
    """48 MB declared, a thousand bytes sent: a step counted (where the whole declared size once was,
    for as long as the host kept it up); the rest, once it comes, counted as it comes."""
    from gateway.intake.fetch import FETCH_STEP_BYTES

    declared = 48 * 2**20
    trickling, peak, fetched = asyncio.run(trickled_then_sent(declared))
    assert trickling == BODY_COPIES * FETCH_STEP_BYTES < BODY_COPIES * declared
    assert peak == BODY_COPIES * declared and fetched == declared


def test_a_declared_body_past_the_whole_budget_is_a_413_before_it_is_read():
    async def fetch_large() -> APIError:
        budget = MemoryBudget()
        budget.size(10 * 2**20)
        current_hold.set(MemoryHold(budget))  # this run's context: later tests do not inherit it
        fetcher = ImageFetcher(FetchLimits(2, 10, 20, 0, allowed_networks=("127.0.0.0/8",)),
                               ImageLimits(64 * 2**20, 10**8, 2, 200))

        async def large_host(reader, writer) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (8 * 2**20) + b"x" * 1000)
            await writer.drain()
            await asyncio.sleep(5)
            writer.close()

        host, port = await server(large_host)
        try:
            await fetcher.fetch(f"http://127.0.0.1:{port}/a.png", "img")
        except APIError as refused:
            return refused
        finally:
            host.close()
            await fetcher.close()
        raise AssertionError("fetched past the budget")

    refused = asyncio.run(fetch_large())
    assert refused.status == 413 and "more than its whole budget" in refused.message
