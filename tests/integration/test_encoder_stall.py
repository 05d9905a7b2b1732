"""The encoder's stall watchdog, on a real encoder service in this process
(real checkpoint, real ZMQ socket, the gateway's wire messages) whose ViT is
held on one batch, as a hung accelerator would hold it: the replica fails
what it holds with 503 `encoder_stalled`, says STALLED in its heartbeat and
takes no new work, then serves again once the batch returns."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import zmq
import zmq.asyncio

from protocol.sockets import AsyncDealer
from protocol.stats import EncoderStats, ServiceState, StatsRequest
from protocol.tensors import to_frame
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.to_gateway import EncodeFailed, EncodeResult, GatewayInbound
from tests.integration.encoder_socket import encoder_in_thread, handshake, reply_to
from tests.waiting import wait_until_async

STALL_MIN_S = 1.0


class HeldTower:
    """The real tower, except that a batch waits for `release` while `hold` is set."""

    def __init__(self, tower) -> None:
        self.tower, self.hold, self.release = tower, threading.Event(), threading.Event()
        self.encode_real = tower.encode
        tower.encode = self.encode

    def encode(self, batch):
        if self.hold.is_set():
            self.release.wait(60)
        return self.encode_real(batch)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    address, service = encoder_in_thread(tmp_path_factory.mktemp("encoder-stall"), max_wait_ms=0, stall_min_s=STALL_MIN_S,
                                         stall_factor=5, stall_restart_s=600)
    held = HeldTower(service.tower)
    yield address, held
    held.release.set()


async def ask(socket: AsyncDealer, request_id: str, seed: int):
    pixels = np.random.default_rng(seed).integers(0, 255, (56, 84, 3), dtype=np.uint8)
    meta, frame = to_frame(pixels)
    await socket.send(EncodeRequest(request_id, [ImageInput(seed.to_bytes(16, "little"), meta)]), [frame])
    message, _ = await reply_to(socket, request_id, timeout_s=30)
    return message


async def stats(socket: AsyncDealer) -> EncoderStats:
    await socket.send(StatsRequest("test"))
    while not isinstance(message := (await asyncio.wait_for(socket.recv(), 10))[0], EncoderStats):
        pass
    return message


async def serving(socket: AsyncDealer) -> bool:
    return (await stats(socket)).state == ServiceState.SERVING


async def stall_then_recover(address: str, held: HeldTower) -> None:
    socket = AsyncDealer(zmq.asyncio.Context.instance(), address, GatewayInbound)
    await handshake(socket)
    assert isinstance(await ask(socket, "warm", 1), EncodeResult)  # the tower warm (its first batch teaches the watchdog nothing)
    held.hold.set()
    started = asyncio.get_running_loop().time()
    failed = await ask(socket, "held", 2)
    waited = asyncio.get_running_loop().time() - started
    assert isinstance(failed, EncodeFailed) and failed.status == 503 and failed.code == "encoder_stalled"
    assert "encoder.stall_factor" in failed.message
    assert waited >= STALL_MIN_S  # the held batch's 60 s or the request's own timeout would have been another answer
    stalled = await stats(socket)
    assert stalled.state == ServiceState.STALLED and stalled.stalls == 1 and stalled.in_flight == 0
    refused = await ask(socket, "while-stalled", 3)
    assert isinstance(refused, EncodeFailed) and refused.status == 503
    held.hold.clear()
    held.release.set()  # the batch returns
    await wait_until_async(lambda: serving(socket), 10, "the encoder serving once the batch returned", 0.1,
                           observe=lambda: stats(socket))
    assert isinstance(await ask(socket, "after", 4), EncodeResult)
    socket.close()


def test_a_batch_held_far_past_its_prediction_stalls_the_replica_until_it_returns(encoder):
    asyncio.run(stall_then_recover(*encoder))
