"""The encoder's queue is bounded by the bytes its waiting work holds
(`encoder.max_queue_bytes`), not only by its count: once half the bound waits,
a request whose pixels would pass it is a 429 the gateway can send elsewhere;
below half, any request may queue (a long video is not starved by small
images). Talks to a standalone encoder over its socket, as the gateway does."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from protocol.sockets import AsyncDealer
from protocol.to_encoder import EncodeRequest
from protocol.to_gateway import EncodeFailed, EncodeResult, GatewayInbound
from tests.integration.encoder_socket import handshake, replies_to, reply_to, start_encoder
from tests.integration.test_encoder_lanes import image_input

QUEUE_BYTES = 100_000  # less than one 224² image's pixels (150,528 bytes)
QUEUE_IMAGES = 3


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """Batches wait 3 s for company (no express lane), so a second request finds the first queued."""
    yield from start_encoder(tmp_path_factory.mktemp("queue"), PRISM_ENCODER__MAX_QUEUE_BYTES=str(QUEUE_BYTES),
                             PRISM_ENCODER__MAX_QUEUE_IMAGES=str(QUEUE_IMAGES), PRISM_ENCODER__MAX_WAIT_MS="3000",
                             PRISM_ENCODER__EXPRESS_MAX_PATCHES="0")


async def send(socket: AsyncDealer, request_id: str, size: tuple[int, int], count: int = 1) -> None:
    images, frames = zip(*(image_input(f"queue-{request_id}-{i}", size) for i in range(count)))
    await socket.send(EncodeRequest(request_id, list(images)), list(frames))


def test_work_past_the_queue_s_bytes_is_refused_once_half_of_them_wait(encoder):
    async def run():
        ctx = zmq.asyncio.Context()
        socket = AsyncDealer(ctx, encoder, GatewayInbound)
        try:
            await handshake(socket)
            await send(socket, "small", (32, 32))  # 3,072 bytes
            await send(socket, "large", (224, 224))  # past the bound with it, but under half of it waits: queued
            await send(socket, "another", (32, 32))  # now more than half waits, and it would pass the bound
            replies = await replies_to(socket, ["another", "small", "large"], timeout_s=120)
            await send(socket, "after", (32, 32))  # the queue empty again
            replies["after"] = (await reply_to(socket, "after", timeout_s=120))[0]
            return replies
        finally:
            socket.close()
            ctx.term()

    replies = asyncio.run(run())
    refused = replies.pop("another")
    assert isinstance(refused, EncodeFailed) and refused.status == 429, refused
    assert "(153,600 bytes waiting; this request's 3,072 would pass encoder.max_queue_bytes, 100,000)" in refused.message
    assert all(isinstance(reply, EncodeResult) for reply in replies.values()), replies


def test_a_request_of_more_images_than_the_queue_holds_is_refused_only_once_half_of_it_waits(encoder):
    """The count bound as the byte bound: a request of many images alone is queued, never refused
    for ever; once half the bound waits, one that would pass it is a 429."""
    async def run():
        ctx = zmq.asyncio.Context()
        socket = AsyncDealer(ctx, encoder, GatewayInbound)
        try:
            await handshake(socket)
            await send(socket, "pair", (32, 32), 2)  # under half of the bound waits: queued
            await send(socket, "two-more", (32, 32), 2)  # now half waits, and it would pass the bound
            replies = await replies_to(socket, ["two-more", "pair"], timeout_s=120)
            await send(socket, "five", (32, 32), QUEUE_IMAGES + 2)  # the queue empty again
            replies["five"] = (await reply_to(socket, "five", timeout_s=120))[0]
            return replies
        finally:
            socket.close()
            ctx.term()

    replies = asyncio.run(run())
    refused = replies.pop("two-more")
    assert isinstance(refused, EncodeFailed) and refused.status == 429, refused
    assert "(2 items waiting; this request's 2 would pass encoder.max_queue_images, 3)" in refused.message
    assert all(isinstance(reply, EncodeResult) for reply in replies.values()), replies
