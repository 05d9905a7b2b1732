"""The encoder's queue is bounded by the bytes its waiting work holds
(`encoder.max_queue_bytes`), not only by its count: while anything waits, a
request whose pixels would pass the bound is a 429 the gateway can send
elsewhere; alone, any request may queue. Talks to a standalone encoder over
its socket, as the gateway does."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from protocol.sockets import AsyncDealer
from protocol.to_encoder import EncodeRequest
from protocol.to_gateway import EncodeFailed, EncodeResult, GatewayInbound
from tests.integration.encoder_socket import handshake, reply_to, start_encoder
from tests.integration.test_encoder_lanes import image_input

QUEUE_BYTES = 100_000  # less than one 224² image's pixels (150,528 bytes)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """Batches wait 3 s for company (no express lane), so a second request finds the first queued."""
    yield from start_encoder(tmp_path_factory.mktemp("queue"), PRISM_ENCODER__MAX_QUEUE_BYTES=str(QUEUE_BYTES),
                             PRISM_ENCODER__MAX_WAIT_MS="3000", PRISM_ENCODER__EXPRESS_MAX_PATCHES="0")


async def send(socket: AsyncDealer, request_id: str, size: tuple[int, int]) -> None:
    image, frame = image_input(f"queue-{request_id}", size)
    await socket.send(EncodeRequest(request_id, [image]), [frame])


def test_work_past_the_queue_s_bytes_is_refused_while_anything_waits(encoder):
    async def run():
        ctx = zmq.asyncio.Context()
        socket = AsyncDealer(ctx, encoder, GatewayInbound)
        try:
            await handshake(socket)
            await send(socket, "large", (224, 224))  # over the bound alone: queued all the same
            await send(socket, "small", (32, 32))  # 3 KB more, while the large one waits
            refused, _ = await reply_to(socket, "small")
            first, _ = await reply_to(socket, "large", timeout_s=120)
            await send(socket, "after", (32, 32))  # the queue empty again
            after, _ = await reply_to(socket, "after", timeout_s=120)
            return refused, first, after
        finally:
            socket.close()
            ctx.term()

    refused, first, after = asyncio.run(run())
    assert isinstance(refused, EncodeFailed) and refused.status == 429, refused
    assert "(150,528 bytes waiting; this request's 3,072 would pass encoder.max_queue_bytes, 100,000)" in refused.message
    assert isinstance(first, EncodeResult) and isinstance(after, EncodeResult)
