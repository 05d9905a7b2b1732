"""What the gateway does when an engine or encoder fails a request or never answers
(gateway/routing/engine_pool.py, clients.py), against real sockets answering as the services
do: a failure before the first token goes to another engine, one after it never does (the
client would get two generations spliced); a service past its deadline is a 504, and the work
is withdrawn from it."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import APIError
from gateway.routing.clients import EncoderClient, EngineClient
from protocol.sockets import AsyncRouter
from protocol.to_encoder import CancelEncode, EncoderInbound, ImageInput
from protocol.to_engine import AbortGenerate, EngineInbound, GenerateRequest
from protocol.to_gateway import GenerateFailed, TokenDelta
from tests.unit.test_client_cancellation import client_and_service
from tests.unit.test_service_states import FakeEngine, two_engines_and_a_pool


class FailingEngine(FakeEngine):
    """Stalls on every request: after `tokens_first` tokens (0 or 1), a 503 the gateway may retry elsewhere."""

    def __init__(self, router: AsyncRouter, tokens_first: int) -> None:
        super().__init__(router)
        self.tokens_first, self.asked = tokens_first, 0

    async def generated(self, peer: bytes, request: GenerateRequest) -> None:
        self.asked += 1
        for n in range(self.tokens_first):
            await self.router.send(peer, TokenDelta(request.request_id, [], n + 1, 1))
        await self.router.send(peer, GenerateFailed(request.request_id, "stalled", 503, "engine_stalled"))


async def _two_failing_engines(tmp_path, tokens_first: int) -> tuple[int, APIError, list[int]]:
    """(deltas the client got, the error it got, requests each engine was asked)."""
    deltas = 0
    async with two_engines_and_a_pool(tmp_path, lambda router: FailingEngine(router, tokens_first)) as (engines, pool):
        with pytest.raises(APIError) as caught:
            async for _ in pool.generate(GenerateRequest("r", b"{}"), timeout_s=5):
                deltas += 1
        return deltas, caught.value, [engine.asked for engine in engines]


def test_a_failure_before_the_first_token_goes_to_another_engine(tmp_path):
    deltas, error, asked = asyncio.run(_two_failing_engines(tmp_path, tokens_first=0))
    assert (deltas, error.status, error.code, sorted(asked)) == (0, 503, "engine_stalled", [1, 1])


def test_a_failure_after_the_first_token_is_never_retried(tmp_path):
    deltas, error, asked = asyncio.run(_two_failing_engines(tmp_path, tokens_first=1))
    assert (deltas, error.status, sorted(asked)) == (1, 503, [0, 1])
    assert "after the first token: not retried" in error.message


def ask_engine(client):
    return anext(client.generate(GenerateRequest("slow", b"{}"), timeout_s=0.2))


def ask_encoder(client):
    return client.encode("slow", [ImageInput(b"d")], [], timeout_s=0.2)


@pytest.mark.parametrize("service,client_class,inbound,ask,code,key,withdrawal", [
    ("engine", EngineClient, EngineInbound, ask_engine, "engine_timeout", "gateway.generate_timeout_s", AbortGenerate("slow")),
    ("encoder", EncoderClient, EncoderInbound, ask_encoder, "encoder_timeout", "gateway.encode_timeout_s", CancelEncode("slow")),
])
def test_a_service_silent_past_the_deadline_is_a_504_and_the_work_is_withdrawn(tmp_path, service, client_class, inbound, ask,
                                                                                code, key, withdrawal):
    async def run() -> None:
        async with client_and_service(tmp_path, service, client_class, inbound) as (client, silent):
            with pytest.raises(APIError) as caught:
                await ask(client)
            assert (caught.value.status, caught.value.code) == (504, code) and key in caught.value.message
            _, request, _ = await asyncio.wait_for(silent.recv(), 5)
            _, withdrawn, _ = await asyncio.wait_for(silent.recv(), 5)
            assert (request.request_id, withdrawn) == ("slow", withdrawal)

    asyncio.run(run())


def test_a_hot_image_s_requests_spill_over_from_the_engine_that_served_it_past_the_load_bound(tmp_path):
    """Its prefix cache there saves a prefill; not a queue of every request for that image
    while the other engines idle."""
    import zmq.asyncio

    from gateway.routing.engine_pool import EnginePool

    async def picks() -> list[int]:
        ctx = zmq.asyncio.Context()
        pool = EnginePool(ctx, [f"ipc://{tmp_path}/engine-{i}.sock" for i in range(3)], heartbeat_timeout_s=5)
        for replica in pool.replicas:
            replica.up = True
        pool.remember([b"hot"], 1)
        chosen = []
        for n in range(6):
            index = pool.pick([b"hot"], set())
            pool.replicas[index].open(f"r{n}")  # outstanding until the end
            chosen.append(index)
        await pool.close()
        ctx.term()
        return chosen

    chosen = asyncio.run(picks())
    assert chosen[0] == 1 and max(chosen.count(i) for i in range(3)) <= 3, chosen  # LOAD_SLACK × the mean of 2, at most


class SilentEngine(FakeEngine):
    """Takes every request and answers none (a long prefill, a queue)."""

    def __init__(self, router: AsyncRouter) -> None:
        super().__init__(router)
        self.asked = 0

    async def generated(self, peer: bytes, request: GenerateRequest) -> None:
        self.asked += 1


def test_a_stopping_gateway_fails_its_requests_with_a_503_and_sends_none_to_another_engine(tmp_path):
    """Before uvicorn's deadline the gateway fails what is in flight with a 503 (app.py,
    end_streams_before_the_drain_deadline). Retried elsewhere as a 503 from an engine is, a request
    was sent to the other engine and cut, answerless, at the deadline: its client got no status."""
    async def run() -> tuple[APIError, APIError, list[int]]:
        async with two_engines_and_a_pool(tmp_path, SilentEngine) as (engines, pool):
            waiting = asyncio.create_task(anext(pool.generate(GenerateRequest("in-flight", b"{}"), timeout_s=30)))
            while sum(engine.asked for engine in engines) == 0:
                await asyncio.sleep(0.01)
            pool.stop_serving("the gateway is shutting down; retry shortly")
            with pytest.raises(APIError) as in_flight:
                await asyncio.wait_for(waiting, 5)
            with pytest.raises(APIError) as later:  # one still in its intake then
                await anext(pool.generate(GenerateRequest("later", b"{}"), timeout_s=30))
            await asyncio.sleep(0.1)  # time for a request to reach an engine, were one sent
            return in_flight.value, later.value, [engine.asked for engine in engines]

    in_flight, later, asked = asyncio.run(run())
    assert sorted(asked) == [0, 1]
    for error in (in_flight, later):
        assert error.status == 503 and "shutting down" in error.message
