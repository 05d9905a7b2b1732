"""How the gateway's client of one service follows what the service says of
itself: it routes only to SERVING, and a restarted process (new boot id) is
used again only after answering the handshake as its predecessor did. A real
DEALER/ROUTER pair; the 'engine' side answers by hand."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq.asyncio

from gateway.errors import APIError
from gateway.routing.clients import EngineClient
from protocol.base import Hello
from protocol.sockets import AsyncRouter
from protocol.stats import EngineStats, ServiceState, StatsRequest
from protocol.to_engine import EngineInbound, GenerateRequest
from protocol.to_gateway import EngineReady, TokenDelta
from tests.waiting import wait_until_async


class FakeEngine:
    def __init__(self, router: AsyncRouter) -> None:
        self.router, self.boot_id, self.state, self.model = router, "boot-1", ServiceState.SERVING, "m"
        self.handshakes = 0
        self.answers_stats = True
        self.gateway = b""  # the peer that last wrote


    async def serve(self) -> None:
        while True:
            peer, message, _ = await self.router.recv()
            self.gateway = peer
            if isinstance(message, Hello):
                self.handshakes += 1
                await self.router.send(peer, EngineReady(self.model, 4096))
            elif isinstance(message, StatsRequest) and self.answers_stats:
                await self.router.send(peer, EngineStats(self.boot_id, 0, 0, 0, 0, self.state))
            elif isinstance(message, GenerateRequest):
                await self.generated(peer, message)

    async def generated(self, peer: bytes, request: GenerateRequest) -> None:
        """One token, then nothing more."""
        await self.router.send(peer, TokenDelta(request.request_id, [], 1, 1))


@contextlib.asynccontextmanager
async def engine_and_client(tmp_path, heartbeat_timeout_s: float, interval_s: float):
    """A fake engine and the gateway's client of it, handshaken and heartbeating; closed after."""
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/engine.sock"
    engine = FakeEngine(AsyncRouter(ctx, address, EngineInbound))
    serving = engine.serving = asyncio.create_task(engine.serve())
    client = EngineClient(ctx, address, "engine", heartbeat_timeout_s=heartbeat_timeout_s)
    try:
        await client.connect(timeout_s=5)
        client.start_heartbeat(interval_s)
        yield engine, client
    finally:
        serving.cancel()
        if not client.socket.socket.closed:
            await client.close()
        if not engine.router.socket.closed:
            engine.router.close()
        ctx.destroy(linger=0)


async def follow_states(tmp_path) -> None:
    async with engine_and_client(tmp_path, heartbeat_timeout_s=30, interval_s=0.05) as (engine, client):
        for state in (ServiceState.STALLED, ServiceState.DEAD, ServiceState.DRAINING):
            engine.state = state
            await wait_until_async(lambda: not client.up, 5, f"the client off a {state.name} engine")
            engine.state = ServiceState.SERVING
            await wait_until_async(lambda: client.up, 5, "the client back on a SERVING engine")
        handshakes = engine.handshakes
        engine.boot_id, engine.model = "boot-2", "another-model"  # restarted, serving something else
        await wait_until_async(lambda: client.stats.boot_id == "boot-2", 5, "the restart seen")
        await wait_until_async(lambda: engine.handshakes >= handshakes + 3, 5, "several handshakes with the restarted engine",
                               observe=lambda: engine.handshakes - handshakes)
        assert not client.up and client.rejoining  # each answered with another model: refused
        engine.model = "m"  # the handshake now matches its predecessor's
        await wait_until_async(lambda: client.up, 5, "the restarted engine rejoined")
        assert not client.rejoining


def test_the_client_routes_only_to_a_serving_service_and_a_restart_rejoins_after_the_handshake(tmp_path):
    asyncio.run(follow_states(tmp_path))


async def _in_flight_when(tmp_path, happening: str) -> APIError:
    """A request with its first token, then `happening`: how its wait ended."""
    async with engine_and_client(tmp_path, heartbeat_timeout_s=0.5, interval_s=0.1) as (engine, client):
        tokens = client.generate(GenerateRequest("r", b"{}"), timeout_s=60)
        await anext(tokens)
        if happening == "closed":  # its model reloaded away, past the drain
            await client.close()
        else:  # draining, then silent without dropping the connection
            engine.state = ServiceState.DRAINING
            await wait_until_async(lambda: not client.up, 5, "the client off the draining engine")
            engine.answers_stats = False
        with pytest.raises(APIError) as ended:
            await anext(tokens)
        return ended.value


@pytest.mark.parametrize("happening", ["closed", "draining-then-silent"])
def test_a_request_in_flight_ends_with_a_503_when_its_engine_goes_away_not_at_its_own_timeout(tmp_path, happening):
    error = asyncio.run(_in_flight_when(tmp_path, happening))
    assert error.status == 503, error.message  # the request's own timeout would have been a 504


async def _endings_when_a_drained_engine_closes(tmp_path, requests: int, tokens: int) -> list[str]:
    """Requests in flight on a draining engine, which streams each to its end and closes its
    socket at once, as llm_engine does once drained (its last replies lingering out): how each
    request's stream ended ("finished", or the error's status)."""
    async with engine_and_client(tmp_path, heartbeat_timeout_s=30, interval_s=0.05) as (engine, client):
        streams = [client.generate(GenerateRequest(f"r{i}", b"{}"), timeout_s=30) for i in range(requests)]
        for stream in streams:
            await anext(stream)  # each has its first token
        engine.state = ServiceState.DRAINING
        await wait_until_async(lambda: not client.up, 5, "the client off the draining engine")
        engine.serving.cancel()
        for count in range(2, tokens + 1):
            for i in range(requests):
                await engine.router.send(engine.gateway, TokenDelta(f"r{i}", [], count, 1, finished=count == tokens))
        engine.router.close(linger_ms=1000)  # llm_engine.service.LAST_REPLIES_LINGER_MS
        endings = []
        for stream in streams:
            try:
                endings.append("finished" if [delta async for delta in stream][-1].finished else "cut short")
            except APIError as error:
                endings.append(str(error.status))
        return endings


def test_a_drained_engine_s_last_replies_reach_their_requests_before_its_close_fails_them(tmp_path):
    """The replies are in the client's socket when the connection drops: zmq must keep them
    (no IMMEDIATE on a dealer that receives) and the client must read them before it fails
    what is still in flight."""
    for attempt in range(10):  # the close lands at once after the last reply: a race, tried over and over
        assert asyncio.run(_endings_when_a_drained_engine_closes(tmp_path, requests=3, tokens=20)) == ["finished"] * 3, attempt


@contextlib.asynccontextmanager
async def two_engines_and_a_pool(tmp_path, make_engine=FakeEngine):
    """Two fake engines (`make_engine(router)`) and the gateway's pool over them, handshaken; closed after."""
    from gateway.routing.engine_pool import EnginePool

    ctx = zmq.asyncio.Context()
    addresses = [f"ipc://{tmp_path}/engine-{i}.sock" for i in range(2)]
    engines = [make_engine(AsyncRouter(ctx, address, EngineInbound)) for address in addresses]
    serving = [asyncio.create_task(engine.serve()) for engine in engines]
    pool = EnginePool(ctx, addresses, heartbeat_timeout_s=30)
    try:
        await pool.connect(timeout_s=5)
        yield engines, pool
    finally:
        await _stop(serving, pool, engines, ctx)


async def _stop(serving: list[asyncio.Task], pool, engines: list[FakeEngine], ctx: zmq.asyncio.Context) -> None:
    for task in serving:
        task.cancel()
    await pool.close()
    for engine in engines:
        engine.router.close()
    ctx.destroy(linger=0)


async def _a_rolling_change_of_model(tmp_path, adopts: bool = True) -> list[tuple[bool, bool, str]]:
    """Two engines restarted one after the other with another model: (up, up, the pool's model) as it goes."""
    seen = []
    async with two_engines_and_a_pool(tmp_path) as (engines, pool):
        pool.adopts = adopts

        def state() -> tuple[bool, bool, str]:
            return pool.replicas[0].up, pool.replicas[1].up, pool.info.model

        pool.start_heartbeat(0.05)
        await wait_until_async(lambda: all(r.stats is not None for r in pool.replicas), 5, "both engines' first stats")
        for index in (0, 1):
            engines[index].boot_id, engines[index].model = "boot-2", "m2"
            await wait_until_async(lambda: pool.replicas[index].stats.boot_id == "boot-2", 5, f"engine {index}'s restart seen")
            if index == 0 or not adopts:  # refused while engine 1 serves m (or for good): asked again at each heartbeat
                await wait_until_async(lambda: engines[index].handshakes >= 3, 5, f"engine {index} handshaken again")
            else:
                await wait_until_async(lambda: all(r.up for r in pool.replicas), 5, "both engines serving m2")
            seen.append(state())
    return seen


def test_replicas_restarted_with_another_model_are_taken_once_none_serves_the_old_one(tmp_path):
    """A rolling change of config: the first restarted engine waits while the other serves the old
    model; once neither does, the pool takes the new answer and both serve."""
    assert asyncio.run(_a_rolling_change_of_model(tmp_path)) == [(False, True, "m"), (True, True, "m2")]


def test_an_unnamed_model_s_engines_restarted_with_another_model_stay_out(tmp_path):
    """A model the config does not name is called what its engines said at start: engines of another
    model would answer under that name (gateway/api/models.py: the pool does not adopt)."""
    assert asyncio.run(_a_rolling_change_of_model(tmp_path, adopts=False)) == [(False, True, "m"), (False, False, "m")]


async def _back_with_the_old_model_after_the_pool_moved_on(tmp_path) -> tuple[bool, bool, str]:
    async with two_engines_and_a_pool(tmp_path) as (engines, pool):
        pool.start_heartbeat(0.05)
        await wait_until_async(lambda: all(r.stats is not None for r in pool.replicas), 5, "both engines' first stats")
        engines[1].state = ServiceState.DRAINING
        await wait_until_async(lambda: not pool.replicas[1].up, 5, "engine 1 out of service")
        engines[0].boot_id, engines[0].model = "boot-2", "m2"  # none other serves: the pool takes m2
        await wait_until_async(lambda: pool.info.model == "m2" and pool.replicas[0].up, 5, "the pool on m2")
        handshakes = engines[1].handshakes
        engines[1].boot_id, engines[1].state = "boot-2", ServiceState.SERVING  # restarted, still serving m
        await wait_until_async(lambda: engines[1].handshakes >= handshakes + 3, 5, "engine 1 handshaken again")
        return pool.replicas[0].up, pool.replicas[1].up, pool.info.model


def test_a_replica_restarted_as_its_predecessor_is_judged_by_what_its_pool_serves_now(tmp_path):
    """Its own last answer is m, but the pool moved on to m2: taken back, it would serve one name as two models."""
    assert asyncio.run(_back_with_the_old_model_after_the_pool_moved_on(tmp_path)) == (True, False, "m2")


async def _a_pool_started_with_one_replica_down(tmp_path) -> list[tuple[bool, bool]]:
    from gateway.routing.engine_pool import EnginePool

    ctx = zmq.asyncio.Context()
    addresses = [f"ipc://{tmp_path}/engine-{i}.sock" for i in range(2)]
    engines, serving = [FakeEngine(AsyncRouter(ctx, addresses[0], EngineInbound))], []
    serving.append(asyncio.create_task(engines[0].serve()))
    pool = EnginePool(ctx, addresses, heartbeat_timeout_s=30)
    seen = []
    try:
        await pool.connect(timeout_s=1)  # engine 1 is not there: the pool starts without it
        pool.start_heartbeat(0.05)
        seen.append((pool.replicas[0].up, pool.replicas[1].up))
        engines.append(FakeEngine(AsyncRouter(ctx, addresses[1], EngineInbound)))  # it comes up later
        serving.append(asyncio.create_task(engines[1].serve()))
        await wait_until_async(lambda: pool.replicas[1].up, 10, "engine 1 joined once it answered")
        await wait_until_async(lambda: pool.replicas[1].stats is not None, 5, "engine 1's heartbeat")
        seen.append((pool.replicas[0].up, pool.replicas[1].up))
    finally:
        await _stop(serving, pool, engines, ctx)
    return seen


def test_a_replica_down_at_start_does_not_stop_its_pool_and_joins_once_it_answers(tmp_path):
    """A gateway restarted while one replica of many is down (a node lost, a pod not scheduled) serves with
    the others instead of failing its start, and uses the late one once it answers its handshake."""
    assert asyncio.run(_a_pool_started_with_one_replica_down(tmp_path)) == [(True, False), (True, True)]
