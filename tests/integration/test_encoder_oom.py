"""The encoder never dies of a batch too large for its device's memory: the
batch is encoded as halves and every request is answered; one image too
large even alone gets a 503 `encoder_out_of_memory` (the gateway retries it
elsewhere) and the encoder goes on serving. The error comes from the
encoder's test hook (`encoder.test_oom_above_rows`), raised as torch raises
it on a GPU."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import zmq.asyncio

from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.to_gateway import EncodeFailed, EncodeResult, GatewayInbound
from tests.integration.encoder_socket import handshake, reply_to, start_encoder, stats_of

ROWS = 1200  # patches a batch may hold: three 448² images (1,024 each) do not fit, one does


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    yield from start_encoder(tmp_path_factory.mktemp("oom"), PRISM_ENCODER__TEST_OOM_ABOVE_ROWS=str(ROWS),
                             PRISM_ENCODER__MAX_WAIT_MS="50", PRISM_ENCODER__VIT_THREADS="1")


def request(request_id: str, sizes: list[tuple[int, int]], seed: int) -> tuple[EncodeRequest, list]:
    rng = np.random.default_rng(seed)
    inputs, frames = [], []
    for h, w in sizes:
        meta, frame = to_frame(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        inputs.append(ImageInput(os.urandom(16), meta))
        frames.append(frame)
    return EncodeRequest(request_id, inputs), frames


async def exchange(address: str):
    socket = AsyncDealer(zmq.asyncio.Context.instance(), address, GatewayInbound)
    try:
        await handshake(socket)
        before = (await stats_of(socket)).oom_splits
        batch, frames = request("four", [(448, 448)] * 4, 1)
        await socket.send(batch, frames)
        four, _ = await reply_to(socket, "four", 120)
        after_split = await stats_of(socket)
        large, frames = request("large", [(1024, 1024)], 2)  # 5,329 patches: over the limit alone
        await socket.send(large, frames)
        refused, _ = await reply_to(socket, "large", 120)
        again, frames = request("again", [(448, 448)], 3)
        await socket.send(again, frames)
        served, _ = await reply_to(socket, "again", 120)
        return four, after_split.oom_splits - before, refused, served
    finally:
        socket.close()


def test_a_batch_over_the_device_memory_is_split_and_one_image_too_large_is_refused(encoder):
    four, splits, refused, served = asyncio.run(exchange(encoder))
    assert isinstance(four, EncodeResult) and len(four.images) == 4
    assert splits >= 2  # 4 → 2 + 2 → 1 + 1 + 1 + 1
    assert isinstance(refused, EncodeFailed), refused
    assert (refused.status, refused.code) == (503, "encoder_out_of_memory")
    assert "device memory" in refused.message
    assert isinstance(served, EncodeResult)
