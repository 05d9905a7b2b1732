"""A small image that comes while the express lane is busy with another waits for the express lane,
not behind a large image's ViT time (vision_encoder/service.py, `_small_work_waits_for_express`):
the main lane's one ViT thread holds a large batch, and a new main batch would have waited behind
it. On a real encoder service in this process (real checkpoint, real ZMQ socket, the gateway's
wire messages) whose first two ViT calls are held until the test lets them go."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import zmq
import zmq.asyncio

from loadtest.synthetic import make_image
from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.to_gateway import EncodeResult, GatewayInbound
from tests.integration.encoder_socket import encoder_in_thread, handshake, stats_of

LARGE, SMALL = (1288, 812), (252, 252)  # 5,336 and 324 patches at the 1 MP budget: main lane and express lane


class GatedTower:
    """The real tower, whose first ViT call (the large image's) and second (the first small image's,
    in the express lane) each wait for their gate; `entered` says each has begun."""

    def __init__(self, tower) -> None:
        self.lock, self.calls = threading.Lock(), 0
        self.gates, self.entered = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
        self.encode_real = tower.encode
        tower.encode = self.encode

    def encode(self, batch):
        with self.lock:
            call, self.calls = self.calls, self.calls + 1
        if call < len(self.gates):
            self.entered[call].set()
            self.gates[call].wait(60)
        return self.encode_real(batch)

    def open_all(self) -> None:
        for gate in self.gates:
            gate.set()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    address, service = encoder_in_thread(tmp_path_factory.mktemp("express"), vit_threads=1, max_wait_ms=0,
                                         max_pixels=1024 * 1024)
    gated = GatedTower(service.tower)
    yield address, gated
    gated.open_all()


async def send(socket: AsyncDealer, request_id: str, size: tuple[int, int], seed: int) -> None:
    pixels = np.asarray(make_image(f"express-{request_id}-{seed}", size).convert("RGB"))
    meta, frame = to_frame(pixels)
    await socket.send(EncodeRequest(request_id, [ImageInput(seed.to_bytes(16, "little"), meta)]), [frame])


async def answers_until(socket: AsyncDealer, request_id: str, answered: list[str], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while request_id not in answered:
            message, _ = await socket.recv()
            if isinstance(message, EncodeResult):
                answered.append(message.request_id)


async def small_while_express_is_busy(address: str, gated: GatedTower) -> list[str]:
    socket = AsyncDealer(zmq.asyncio.Context.instance(), address, GatewayInbound)
    await handshake(socket)
    answered: list[str] = []
    try:
        await send(socket, "large", LARGE, 1)
        assert await asyncio.to_thread(gated.entered[0].wait, 60), "the large image's batch in the ViT"
        await send(socket, "small-1", SMALL, 2)
        assert await asyncio.to_thread(gated.entered[1].wait, 60), "the first small image in the express lane"
        await send(socket, "small-2", SMALL, 3)
        for _ in range(2):  # asked one after the other: the second is read after the turn that took small-2 ended
            await stats_of(socket)
        gated.gates[1].set()  # the express lane frees
        await answers_until(socket, "small-2", answered, 30)  # the large one is still held
        gated.gates[0].set()
        await answers_until(socket, "large", answered, 60)
    finally:
        gated.open_all()
        socket.close()
    return answered


def test_a_small_image_waits_for_the_busy_express_lane_not_behind_a_large_batch(encoder):
    assert asyncio.run(small_while_express_is_busy(*encoder)) == ["small-1", "small-2", "large"]
