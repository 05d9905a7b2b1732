"""The engine's token stream to a gateway that stops reading: after the
router's wait it gives the stream up (vLLM aborts it) and, once the gateway
reads again, tells it so, rather than leaving the client waiting out the
gateway's generate_timeout_s."""

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio

from llm_engine.service import EngineService
from protocol.base import Hello
from protocol.sockets import AsyncRouter, pack
from protocol.to_engine import EngineInbound
from protocol.to_gateway import STREAM_DROPPED, GatewayInbound, GenerateFailed, TokenDelta
from tests.unit.test_protocol import _fill

ADDRESS = "inproc://engine-send"


def _service(router: AsyncRouter) -> EngineService:
    return EngineService(config=SimpleNamespace(served_model_name="m", model="m"), engine=None, router=router, watch=None, shape=None, generation_defaults={}, images=None)


async def _read_all(dealer: zmq.asyncio.Socket) -> list:
    """Every message queued to `dealer`, read until none comes for a while."""
    decoder = msgspec.msgpack.Decoder(GatewayInbound | Hello)  # the filler is Hello
    read = []
    while await dealer.poll(1000):
        parts = await dealer.recv_multipart()
        read.append(decoder.decode(parts[0]))
    return read


async def _a_stream_to_a_gateway_that_stopped_reading(message, expected: tuple, wait: bool):
    ctx = zmq.asyncio.Context()
    router = AsyncRouter(ctx, ADDRESS, EngineInbound, full_peer_wait_s=0.3)
    gateway = ctx.socket(zmq.DEALER)
    try:
        gateway.connect(ADDRESS)
        await gateway.send_multipart(pack(Hello("gateway")))
        peer = (await asyncio.wait_for(router.recv(), 5))[0]
        await _fill(router, peer)
        service = _service(router)
        assert not await service._send(peer, message, wait=wait)  # given up: a stream ends (vLLM aborts it)
        await asyncio.sleep(0.6)  # past the router's own wait: the notice waits longer than a token does
        told = [m for m in await _read_all(gateway) if isinstance(m, GenerateFailed)]
        assert [(m.request_id, m.status, m.code) for m in told] == [expected]
        assert not service._background  # the notice's send is done
    finally:
        gateway.close(linger=0)
        router.close()
        ctx.term()


@pytest.mark.parametrize("message,expected,wait", [
    (TokenDelta(request_id="r1", choices=[], completion_tokens=3, prompt_tokens=5), ("r1", 503, STREAM_DROPPED), True),
    (GenerateFailed("r1", "the request's own fault", 400), ("r1", 400, None), True),  # its answer, not a 504 at the timeout
    # the receive loop's refusals (engine full, draining), sent without waiting on the gateway
    (GenerateFailed("r1", "engine queue is full", 429), ("r1", 429, None), False),
], ids=["a-stream", "a-refusal", "a-refusal-from-the-receive-loop"])
def test_what_a_full_gateway_could_not_take_reaches_it_once_it_reads_again(message, expected, wait):
    asyncio.run(_a_stream_to_a_gateway_that_stopped_reading(message, expected, wait))
