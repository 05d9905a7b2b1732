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

from llm_engine.service import ENGINE_FAILED, EngineService
from protocol.base import Hello
from protocol.sockets import AsyncRouter, pack
from protocol.to_engine import EngineInbound
from protocol.to_gateway import STREAM_DROPPED, GatewayInbound, GenerateFailed, TokenDelta
from tests.unit.test_protocol import _fill

ADDRESS = "inproc://engine-send"


def _service(router: AsyncRouter) -> EngineService:
    config = SimpleNamespace(served_model_name="m", model="m", max_waiting_requests=256, scheduling_policy="fcfs")
    return EngineService(config=config, engine=None, router=router, watch=None, shape=None, generation_defaults={}, images=None)


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


async def _reply_when_an_output_cannot_be_turned_into_a_delta() -> list:
    """vLLM took the request and answered; turning its output into a reply raised a ValueError
    (a parser, an unencodable string): that is the engine's failure, not the request's."""
    from protocol.to_engine import GenerateRequest

    class Output:
        @property
        def outputs(self):
            raise ValueError("a parser choked on the model's output")

    async def generate(*_args, **_kwargs):
        yield Output()

    ctx = zmq.asyncio.Context()
    router = AsyncRouter(ctx, ADDRESS, EngineInbound)
    gateway = ctx.socket(zmq.DEALER)
    try:
        gateway.connect(ADDRESS)
        await gateway.send_multipart(pack(Hello("gateway")))
        peer = (await asyncio.wait_for(router.recv(), 5))[0]
        service = _service(router)
        service.engine = SimpleNamespace(generate=generate, errored=False)
        service.watch = SimpleNamespace(note_work_arrived=lambda *_args, **_kwargs: None)
        service.images = SimpleNamespace(tensors=lambda _refs: asyncio.sleep(0, []))
        read = SimpleNamespace(chat=None, new_parser=lambda: None, reasoning=lambda _ids: {})
        service._read_and_render = lambda _request: (read, [1, 2])
        service._plan = lambda *_args: asyncio.sleep(0, (SimpleNamespace(inputs={}, num_tokens=2, max_tokens=4), None))
        await service._generate(peer, GenerateRequest("r", b"{}"), 0.0)
        return [m for m in await _read_all(gateway) if isinstance(m, GenerateFailed)]
    finally:
        gateway.close(linger=0)
        router.close()
        ctx.term()


def test_a_failure_past_vllm_s_answer_is_the_engine_s_500_not_the_request_s_400():
    (failed,) = asyncio.run(_reply_when_an_output_cannot_be_turned_into_a_delta())
    # the error's own text (paths, internals) stays in the engine's log
    assert failed.status == 500 and failed.message == ENGINE_FAILED and "a parser choked" not in failed.message, failed


async def _busy_while_the_last_delta_waits_on_its_gateway() -> bool:
    """Whether the stall watch still counted the request as vLLM's while its finished delta's send waited."""
    async def generate(*_args, **_kwargs):
        yield SimpleNamespace(outputs=[], finished=True, metrics=None, num_cached_tokens=0, prompt_token_ids=[1, 2],
                              prompt_logprobs=None)

    service = _service(router=None)
    service.engine = SimpleNamespace(generate=generate, errored=False)
    service.watch = SimpleNamespace(note_work_arrived=lambda *_args, **_kwargs: None)
    busy_at_send = []

    async def send(peer, message, wait=True, wait_s=None) -> bool:  # a gateway slow to read: the send waits
        busy_at_send.append(bool(service.generating))
        await asyncio.sleep(0.01)
        return True

    service._send = send
    read = SimpleNamespace(chat=SimpleNamespace(priority=0, return_token_ids=False, stream=True), new_parser=lambda: None)
    prompt = SimpleNamespace(inputs={}, num_tokens=2, max_tokens=4, text=None)
    await service._stream(b"gateway", "r", prompt, None, (0.0, 0.0), read, {})
    return busy_at_send == [True]


def test_a_finished_request_whose_last_send_waits_is_no_work_of_vllm_s():
    """The stall watch calls a stall when vLLM holds work and makes no step: a finished request
    whose last delta waited (up to the router's 10 s) on a gateway slow to read counted as such,
    and a stall timeout under that wait failed every request in flight with 503 engine_stalled."""
    assert not asyncio.run(_busy_while_the_last_delta_waits_on_its_gateway())
