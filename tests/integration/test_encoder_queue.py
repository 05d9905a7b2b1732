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


async def send(socket: AsyncDealer, request_id: str, size: tuple[int, int], count: int = 1, priority: int = 0) -> None:
    images, frames = zip(*(image_input(f"queue-{request_id}-{i}", size) for i in range(count)))
    await socket.send(EncodeRequest(request_id, list(images), priority=priority), list(frames))


def refused_between(address: str, before: list[tuple], refused: tuple, after: tuple) -> tuple[EncodeFailed, dict]:
    """Each of `before` sent at once, then `refused` (each (request id, image size, images)); once they
    are answered, `after` on an empty queue. (`refused`'s reply, every other reply by request id.)"""
    async def run() -> dict:
        ctx = zmq.asyncio.Context()
        socket = AsyncDealer(ctx, address, GatewayInbound)
        try:
            await handshake(socket)
            for request in (*before, refused):
                await send(socket, *request)
            replies = await replies_to(socket, [refused[0], *(request[0] for request in before)], timeout_s=120)
            await send(socket, *after)
            replies[after[0]] = (await reply_to(socket, after[0], timeout_s=120))[0]
            return replies
        finally:
            socket.close()
            ctx.term()

    replies = asyncio.run(run())
    answer = replies.pop(refused[0])
    assert isinstance(answer, EncodeFailed) and answer.status == 429, answer
    assert all(isinstance(reply, EncodeResult) for reply in replies.values()), replies
    return answer, replies


def test_work_past_the_queue_s_bytes_is_refused_once_half_of_them_wait(encoder):
    refused, _ = refused_between(
        encoder,
        # 3,072 bytes, then one past the bound with it, but under half of it waits: queued
        before=[("small", (32, 32), 1), ("large", (224, 224), 1)],
        refused=("another", (32, 32), 1),  # now more than half waits, and it would pass the bound
        after=("after", (32, 32), 1),  # the queue empty again
    )
    assert "(153,600 bytes waiting; this request's 3,072 would pass encoder.max_queue_bytes, 100,000)" in refused.message


def test_a_request_of_more_images_than_the_queue_holds_is_refused_only_once_half_of_it_waits(encoder):
    """The count bound as the byte bound: a request of many images alone is queued, never refused
    for ever; once half the bound waits, one that would pass it is a 429."""
    refused, _ = refused_between(
        encoder,
        before=[("pair", (32, 32), 2)],  # under half of the bound waits: queued
        refused=("two-more", (32, 32), 2),  # now half waits, and it would pass the bound
        after=("five", (32, 32), QUEUE_IMAGES + 2),  # the queue empty again
    )
    assert "(2 items waiting; this request's 2 would pass encoder.max_queue_images, 3)" in refused.message


def test_a_more_urgent_request_takes_the_place_of_less_urgent_queued_work_and_an_equal_one_is_refused(encoder):
    """With priorities (sent where the engines schedule by them): the least urgent queued work makes room,
    each request waiting on it refused 429 "displaced" for the gateway to send elsewhere; a request no
    more urgent than what waits is refused as before."""
    async def run() -> dict:
        ctx = zmq.asyncio.Context()
        socket = AsyncDealer(ctx, encoder, GatewayInbound)
        try:
            await handshake(socket)
            await send(socket, "background", (32, 32), 2, priority=5)  # under half the bound: queued
            await send(socket, "urgent", (32, 32), 2, priority=-1)  # past it: the background's place
            await send(socket, "as-urgent", (32, 32), 2, priority=-1)  # none less urgent left: refused
            return await replies_to(socket, ["background", "urgent", "as-urgent"], timeout_s=120)
        finally:
            socket.close()
            ctx.term()

    replies = asyncio.run(run())
    assert isinstance(replies["urgent"], EncodeResult)
    assert (replies["background"].status, replies["background"].code) == (429, "displaced")
    assert (replies["as-urgent"].status, replies["as-urgent"].code) == (429, None)


def test_an_image_sent_twice_in_one_request_counts_once_against_the_queue(encoder):
    """The second copy joins the first's encode: one more item, not two (two would pass the bound of 3)."""
    async def run() -> dict:
        ctx = zmq.asyncio.Context()
        socket = AsyncDealer(ctx, encoder, GatewayInbound)
        try:
            await handshake(socket)
            await send(socket, "waiting-pair", (32, 32), 2)
            image, frame = image_input("queue-twice", (32, 32))
            await socket.send(EncodeRequest("twice", [image, image]), [frame, frame])
            return await replies_to(socket, ["waiting-pair", "twice"], timeout_s=120)
        finally:
            socket.close()
            ctx.term()

    replies = asyncio.run(run())
    assert isinstance(replies["twice"], EncodeResult), replies["twice"]
