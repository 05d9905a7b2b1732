"""A client that hangs up cancels the request's task; that cancel must never be
lost, or vLLM generates to the end for no one (CPython gh-86296: on 3.11,
`asyncio.wait_for` drops a cancel that lands in the same turn as a reply)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq.asyncio

from gateway.routing.clients import EngineClient, next_reply
from protocol.sockets import AsyncRouter
from protocol.to_engine import AbortGenerate, EngineInbound, GenerateRequest
from protocol.to_gateway import ChoiceDelta, TokenDelta


async def _reply_lands_with_the_cancel() -> asyncio.Task:
    queue: asyncio.Queue = asyncio.Queue()

    async def consume() -> None:
        while True:
            await next_reply(queue, timeout_s=30)

    consumer = asyncio.create_task(consume())
    for _ in range(3):  # the consumer is now waiting on the queue
        await asyncio.sleep(0)
    queue.put_nowait(("delta", []))
    await asyncio.sleep(0)  # the reply is handed over...
    consumer.cancel()  # ...and the hang-up arrives before the consumer runs
    await asyncio.wait([consumer], timeout=5)  # ended by the cancel, unless it was swallowed (the caller asserts)
    return consumer


def test_a_cancel_that_lands_with_a_reply_is_kept():
    async def run() -> None:
        consumer = await _reply_lands_with_the_cancel()
        assert consumer.done(), "the cancel was swallowed: the consumer kept waiting for replies"
        assert consumer.cancelled()

    asyncio.run(run())


def test_no_reply_within_the_timeout_is_a_timeout_error():
    async def run() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await next_reply(asyncio.Queue(), timeout_s=0.05)

    asyncio.run(run())


@contextlib.asynccontextmanager
async def client_and_service(tmp_path, name: str = "engine", client_class=EngineClient, inbound=EngineInbound):
    """A real DEALER/ROUTER pair on loopback, on a context of their own: the client, marked up and
    reading its replies, and the service's ROUTER."""
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/{name}.sock"
    service = AsyncRouter(ctx, address, inbound)
    client = client_class(ctx, address, name, heartbeat_timeout_s=30)
    client.up = True
    client._tasks.append(asyncio.create_task(client._receive_loop()))
    try:
        yield client, service
    finally:
        await client.close()
        service.close()
        ctx.term()


def test_an_abandoned_generation_is_aborted_in_the_engine(tmp_path):
    """A real DEALER/ROUTER pair on loopback: the 'engine' streams deltas as
    fast as it can; the consumer is cancelled mid-stream, many times over,
    and every time the generation ends cancelled and an abort goes out."""

    async def run() -> None:
        async with client_and_service(tmp_path) as (client, engine):
            for attempt in range(20):
                await _hang_up_mid_stream(client, engine, f"r{attempt}", after=attempt % 5 + 1)

    asyncio.run(run())


async def _hang_up_mid_stream(client: EngineClient, engine: AsyncRouter, rid: str, after: int) -> None:
    request = GenerateRequest(rid, b'{"messages":[],"max_tokens":10000}')
    received = 0
    first = asyncio.Event()

    async def consume() -> None:
        nonlocal received
        async for _ in client.generate(request, timeout_s=30):
            received += 1
            if received == after:
                first.set()

    consumer = asyncio.create_task(consume())
    peer, message, _ = await engine.recv()
    assert message == request

    async def stream() -> None:
        for n in range(1, 10_001):
            await engine.send(peer, TokenDelta(rid, [ChoiceDelta(0, "x")], n, 5))
            await asyncio.sleep(0)  # one turn of the loop: the consumer reads between deltas

    streaming = asyncio.create_task(stream())
    await asyncio.wait_for(first.wait(), 10)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(consumer, 10)
    streaming.cancel()
    _, abort, _ = await asyncio.wait_for(engine.recv(), 10)
    assert abort == AbortGenerate(rid)
    assert rid not in client._streams


def test_a_generation_abandoned_while_its_engine_drains_is_still_aborted(tmp_path):
    """A draining (or stalled) engine is not up for new work, yet it runs what it has: a client
    that hangs up then must still stop its generation, or it runs to max_tokens and holds the drain."""

    async def run() -> None:
        async with client_and_service(tmp_path) as (client, engine):
            request = GenerateRequest("draining", b'{"messages":[],"max_tokens":10000}')
            stream = client.generate(request, timeout_s=30)
            consumer = asyncio.create_task(anext(stream))
            peer, _, _ = await asyncio.wait_for(engine.recv(), 10)
            await engine.send(peer, TokenDelta("draining", [ChoiceDelta(0, "x")], 1, 5))
            await asyncio.wait_for(consumer, 10)
            client.up = False  # its heartbeat said DRAINING
            await stream.aclose()  # the client hung up
            _, abort, _ = await asyncio.wait_for(engine.recv(), 10)
            assert abort == AbortGenerate("draining")

    asyncio.run(run())


def test_work_failed_over_from_a_silent_service_is_withdrawn_from_it(tmp_path):
    """A service silent past the heartbeat timeout is marked down and its requests fail over to
    another replica; it may be alive (a stalled host), so the work is withdrawn from it too, or it
    runs twice: once for no one."""
    from gateway.errors import APIError
    from gateway.routing.clients import EncoderClient
    from protocol.to_encoder import CancelEncode, EncoderInbound

    async def run() -> None:
        async with (client_and_service(tmp_path) as (engine_client, engine),
                    client_and_service(tmp_path, "encoder", EncoderClient, EncoderInbound) as (encoder_client, encoder)):
            generating = asyncio.create_task(anext(engine_client.generate(GenerateRequest("silent", b"{}"), timeout_s=30)))
            encoding = asyncio.create_task(encoder_client.encode("silent", [], [], timeout_s=30))
            await asyncio.wait_for(engine.recv(), 10)
            await asyncio.wait_for(encoder.recv(), 10)
            for client in (engine_client, encoder_client):
                client._mark_down("stopped answering (5.0 s > gateway.heartbeat_timeout_s)")
            for task in (generating, encoding):
                with pytest.raises(APIError):
                    await asyncio.wait_for(task, 10)
            assert (await asyncio.wait_for(engine.recv(), 10))[1] == AbortGenerate("silent")
            assert (await asyncio.wait_for(encoder.recv(), 10))[1] == CancelEncode("silent")

    asyncio.run(run())
