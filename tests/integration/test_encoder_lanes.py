"""A small image is never held behind a large one's ViT time: while the main
lane encodes a megapixel image, a 256² image sent after it goes through the
encoder's express lane and is answered first (vision_encoder/service.py).
With two ViT threads (`encoder.vit_threads`) a second batch too large for the
express lane runs beside the first instead of after it (the encoder's stats
count the batches in the ViT at once), and its tokens are the ones one thread
makes. Talks to standalone encoders over their sockets, as the
gateway does."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch
import zmq.asyncio

from loadtest.synthetic import make_image
from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.stats import EncoderStats
from protocol.to_gateway import EncodeResult, GatewayInbound
from tests.integration.encoder_socket import encode_directly, fetch_tokens, handshake, start_encoder, stats_of
from tests.waiting import wait_until_async

# At the 1 MP budget: 5,336, 324 and 2,500 patches (MEDIUM: past the express
# lane's 1,024, within the batcher's size ratio of LARGE, a fifth of its ViT time)
LARGE, SMALL, MEDIUM = (1288, 812), (252, 252), (700, 700)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """One ViT thread (the CPU demo config has two): the express lane alone keeps the small image apart."""
    yield from start_encoder(tmp_path_factory.mktemp("lanes"), PRISM_ENCODER__VIT_THREADS="1")


@pytest.fixture(scope="module")
def two_vit_threads(tmp_path_factory):
    yield from start_encoder(tmp_path_factory.mktemp("two-vit"), PRISM_ENCODER__VIT_THREADS="2",
                             PRISM_ENCODER__EXTRA_VIT_NICE="10")


def image_input(name: str, size: tuple[int, int]) -> tuple[ImageInput, memoryview]:
    meta, frame = to_frame(np.asarray(make_image(name, size).convert("RGB")))
    return ImageInput(os.urandom(16), meta), frame


async def send_image(socket: AsyncDealer, request_id: str, size: tuple[int, int]) -> None:
    image, frame = image_input(f"lanes-{request_id}", size)
    await socket.send(EncodeRequest(request_id, [image]), [frame])


async def answer_order(address: str, second: tuple[int, int] = SMALL) -> tuple[list[str], EncoderStats, EncoderStats]:
    """Send a large image and, once its batch is in the ViT, a `second` one: the
    order their answers come in, and the encoder's stats before and after."""
    ctx = zmq.asyncio.Context()
    socket, watch = (AsyncDealer(ctx, address, GatewayInbound) for _ in range(2))  # `watch`: stats only
    try:
        await handshake(socket)
        before = await stats_of(watch)
        await send_image(socket, "large", LARGE)
        await wait_until_async(lambda: batches_in_vit(watch), 60, "the large image's batch in the ViT")
        await send_image(socket, "small", second)
        order = []
        while len(order) < 2:
            message, _ = await asyncio.wait_for(socket.recv(), 120)
            if isinstance(message, EncodeResult):
                order.append(message.request_id)
        return order, before, await stats_of(watch)
    finally:
        socket.close()
        watch.close()
        ctx.term()


async def batches_in_vit(watch: AsyncDealer) -> int:
    return (await stats_of(watch)).vit_batches_now


def test_a_small_image_sent_after_a_large_one_is_answered_first(encoder):
    order, _, after = asyncio.run(answer_order(encoder))
    assert order == ["small", "large"], after  # a small part of the large one's patches, on a thread of its own


def test_with_two_vit_threads_a_second_large_batch_runs_beside_the_first(two_vit_threads):
    # Which answer comes first depends on how the machine shares its CPUs
    # between the two threads; that both batches were in the ViT at once does not.
    order, before, after = asyncio.run(answer_order(two_vit_threads, MEDIUM))
    assert sorted(order) == ["large", "small"]
    assert before.vit_batches_most <= 1 and after.vit_batches_most == 2, (before, after)


def test_with_one_vit_thread_the_second_batch_waits_for_the_first(encoder):
    """The test above can fail: one thread never holds two batches in the ViT,
    and answers the same two images in order."""
    order, _, after = asyncio.run(answer_order(encoder, MEDIUM))
    assert after.vit_batches_most == 1, after
    assert order == ["large", "small"], after


async def tokens_of(address: str, name: str):
    reply = await encode_directly(address, [name], MEDIUM)
    ctx = zmq.asyncio.Context()
    try:
        (tokens,) = await fetch_tokens(ctx, address, reply.images)
        return tokens
    finally:
        ctx.term()


def test_two_vit_threads_make_the_tokens_one_thread_makes(encoder, two_vit_threads):
    one, two = (asyncio.run(tokens_of(address, "lanes-same")) for address in (encoder, two_vit_threads))
    assert one is not None and two is not None
    assert torch.equal(one, two)
