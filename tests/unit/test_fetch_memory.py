"""What an http(s) image's fetch counts against the gateway's memory budget (gateway/intake/fetch.py),
against real local servers: nothing while the host has not answered, the size it declares while its
body comes, nothing once the fetch has ended (its bytes are then the request's to hold)."""

from __future__ import annotations

import asyncio

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
