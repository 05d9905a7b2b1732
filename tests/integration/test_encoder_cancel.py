"""A batch whose every request went away before its ViT stage began is not run (vision_encoder/work.py,
`abandoned`): a client that hangs up, or a gateway that gives up, costs the encoder no ViT time for
work already handed to a lane. On a real encoder service in this process (real checkpoint, real ZMQ
socket, the gateway's wire messages) whose first ViT call is held until the test lets it go."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq
import zmq.asyncio

from protocol.sockets import AsyncDealer
from protocol.to_encoder import CancelEncode
from protocol.stats import ServiceState
from protocol.to_gateway import EncodeFailed, EncodeResult, GatewayInbound
from tests.integration.encoder_socket import encoder_in_thread, handshake, reply_to, stats_of
from tests.integration.test_express_lane import GatedTower, send
from tests.waiting import wait_until_async


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """One ViT thread and no express lane: a second batch waits in the main lane behind the first."""
    address, service = encoder_in_thread(tmp_path_factory.mktemp("cancel"), vit_threads=1, max_wait_ms=0,
                                         express_max_patches=0, max_pixels=1024 * 1024)
    gated = GatedTower(service.tower)
    gated.gates[1].set()  # only the first call is held
    yield address, gated
    gated.open_all()


async def queue_empty(socket: AsyncDealer) -> bool:
    return (await stats_of(socket)).queue_depth == 0


async def dropped_since(socket: AsyncDealer, before: int) -> bool:
    return (await stats_of(socket)).jobs_dropped > before


async def cancel_a_waiting_batch(address: str, gated: GatedTower) -> tuple[int, int, int]:
    """(ViT calls once the held batch returned, once the cancelled image was sent again, batches dropped)."""
    socket = AsyncDealer(zmq.asyncio.Context.instance(), address, GatewayInbound)
    await handshake(socket)
    try:
        await send(socket, "held", (700, 700), 11)
        assert await asyncio.to_thread(gated.entered[0].wait, 60), "the first batch in the ViT"
        dropped = (await stats_of(socket)).jobs_dropped
        await send(socket, "gone", (700, 700), 12)  # its batch waits for the ViT thread
        await wait_until_async(lambda: queue_empty(socket), 10, "the image taken into a batch of the lane (where a "
                               "cancel does not reach it in the queue)")
        await socket.send(CancelEncode("gone"))
        for _ in range(2):  # asked one after the other: the second is read after the turn that took the cancel
            await stats_of(socket)
        gated.gates[0].set()
        assert isinstance((await reply_to(socket, "held", 60))[0], EncodeResult)
        await wait_until_async(lambda: dropped_since(socket, dropped), 10, "the cancelled batch's turn on the ViT thread")
        after_cancel = gated.calls
        await send(socket, "again", (700, 700), 12)  # the same image: encoded now, nothing kept of the skip
        assert isinstance((await reply_to(socket, "again", 60))[0], EncodeResult)
        return after_cancel, gated.calls, (await stats_of(socket)).jobs_dropped - dropped
    finally:
        gated.open_all()
        socket.close()


def test_a_batch_nobody_waits_on_any_more_is_not_run(encoder):
    assert asyncio.run(cancel_a_waiting_batch(*encoder)) == (1, 2, 1)


class HeldPreprocessing:
    """The real tower, whose first preprocessing waits for `gate` (a batch whose ViT thread waits on it)."""

    def __init__(self, tower) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls, self.preprocess_real = 0, tower.preprocess
        tower.preprocess = self.preprocess

    def preprocess(self, images):
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            self.gate.wait(60)
        return self.preprocess_real(images)


@pytest.fixture(scope="module")
def stalling_encoder(tmp_path_factory):
    address, service = encoder_in_thread(tmp_path_factory.mktemp("stall-skip"), vit_threads=1, max_wait_ms=0,
                                         express_max_patches=0, stall_min_s=1.0, stall_factor=5, stall_restart_s=600)
    held = HeldPreprocessing(service.tower)
    yield address, held
    held.gate.set()


async def serving(socket: AsyncDealer) -> bool:
    return (await stats_of(socket)).state == ServiceState.SERVING


async def stall_in_preprocessing_then_recover(address: str, held: HeldPreprocessing) -> None:
    socket = AsyncDealer(zmq.asyncio.Context.instance(), address, GatewayInbound)
    await handshake(socket)
    try:
        await send(socket, "stalls", (252, 252), 21)
        assert await asyncio.to_thread(held.entered.wait, 60), "the batch in its preprocessing"
        failed, _ = await reply_to(socket, "stalls", 30)
        assert isinstance(failed, EncodeFailed) and failed.code == "encoder_stalled"  # its request failed by the stall
        dropped = (await stats_of(socket)).jobs_dropped
        held.gate.set()  # the batch returns, skipped: nobody waits on it any more
        await wait_until_async(lambda: serving(socket), 10, "the encoder serving once the stalled batch returned",
                               observe=lambda: stats_of(socket))
        assert (await stats_of(socket)).jobs_dropped == dropped + 1  # skipped, not run through the ViT
        await send(socket, "after", (252, 252), 22)
        assert isinstance((await reply_to(socket, "after", 60))[0], EncodeResult)
    finally:
        held.gate.set()
        socket.close()


def test_a_stalled_batch_that_returns_skipped_ends_the_stall(stalling_encoder):
    """Its requests were failed by the stall, so it returns without running: that ends the stall as
    any return of the stalled batch does, or the encoder would refuse everything until it restarts."""
    asyncio.run(stall_in_preprocessing_then_recover(*stalling_encoder))
