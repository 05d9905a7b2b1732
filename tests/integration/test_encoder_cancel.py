"""A batch whose every request went away before its ViT stage began is not run (vision_encoder/work.py,
`abandoned`): a client that hangs up, or a gateway that gives up, costs the encoder no ViT time for
work already handed to a lane. On a real encoder service in this process (real checkpoint, real ZMQ
socket, the gateway's wire messages) whose first ViT call is held until the test lets it go."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from protocol.sockets import AsyncDealer
from protocol.to_encoder import CancelEncode
from protocol.to_gateway import EncodeResult, GatewayInbound
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
