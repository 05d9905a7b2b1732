"""Discovery: the gateway's pools follow what their host names resolve to.

Real pools and real DEALER/ROUTER sockets on loopback; only the resolver is a
stub (host → IPs), standing for a headless Service whose A records change as
pods come and go. Fake engines at 127.0.0.1 and 127.0.0.2 answer the
handshake, the heartbeat and generations while requests keep running.
"""

from __future__ import annotations

import asyncio
import itertools
import socket

import pytest
import zmq.asyncio

from gateway.routing.discovery import dns_lookup, replica_addresses, resolve_all
from gateway.routing.encoder_pool import EncoderPool
from gateway.routing.engine_pool import EnginePool
from protocol.base import Hello
from protocol.sockets import AsyncRouter
from protocol.stats import EngineStats, StatsRequest
from protocol.to_engine import EngineInbound, GenerateRequest
from protocol.to_gateway import ChoiceDelta, EngineReady, TokenDelta
from tests.waiting import wait_until_async

NAME = "llm-engine.prism.svc"
DELTAS = 4  # per generation


class Records:
    """A stub resolver whose answers the test changes."""

    def __init__(self, *ips: str) -> None:
        self.ips = list(ips)
        self.calls = 0

    def lookup(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if host != NAME or not self.ips:
            raise socket.gaierror(f"{host}: no such name")
        return list(self.ips)


class FakeEngine:
    """Streams DELTAS deltas per request; with `hold` cleared, stops after the first until it is set."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, model: str = "m") -> None:
        self.router = AsyncRouter(ctx, address, EngineInbound)
        self.model, self.handshakes = model, 0
        self.received: list[int] = []  # request numbers, in arrival order
        self.held = 0  # streams waiting for `hold` after their first delta
        self.hold = asyncio.Event()
        self.hold.set()
        self._tasks: set[asyncio.Task] = set()
        self._serving = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            peer, message, _ = await self.router.recv()
            if isinstance(message, Hello):
                self.handshakes += 1
                await self.router.send(peer, EngineReady(self.model, 4096))
            elif isinstance(message, StatsRequest):
                await self.router.send(peer, EngineStats("boot", 0, 0, 0, 0))
            elif isinstance(message, GenerateRequest):
                self.received.append(int(message.request_id))
                task = asyncio.create_task(self._stream(peer, message.request_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _stream(self, peer: bytes, request_id: str) -> None:
        for n in range(1, DELTAS + 1):
            await self.router.send(peer, TokenDelta(request_id, [ChoiceDelta(0, "x")], n, 1, finished=n == DELTAS))
            if n == 1 and not self.hold.is_set():
                self.held += 1
                await self.hold.wait()
                self.held -= 1
            await asyncio.sleep(0.005)  # paced: a stream lasts long enough for pods to come and go under it

    def stop(self) -> None:
        for task in (self._serving, *self._tasks):
            task.cancel()
        self.router.close()


async def bind_again(ctx: zmq.asyncio.Context, address: str) -> FakeEngine:
    """A fake engine at an address just closed: ZMQ releases the port in its own
    thread, so the first binds may find it still taken."""
    bound: list[FakeEngine] = []

    def bind() -> bool:
        try:
            bound.append(FakeEngine(ctx, address))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
        return bool(bound)

    await wait_until_async(bind, 10, f"{address} free to bind again", every_s=0.05)
    return bound[0]


async def until(predicate, what: str) -> None:
    await wait_until_async(predicate, 20, what)  # the timeout only keeps a broken build from hanging


class Load:
    """Workers sending one generation after another, each numbered when it is created."""

    def __init__(self, pool: EnginePool, workers: int) -> None:
        self.pool = pool
        self.numbers = itertools.count(1)
        self.completed = 0
        self.failures: list[BaseException] = []
        self._tasks = [asyncio.create_task(self._work()) for _ in range(workers)]

    async def _work(self) -> None:
        while True:
            request_id = str(next(self.numbers))  # numbered and routed with no await between
            deltas = []
            try:
                async for delta in self.pool.generate(GenerateRequest(request_id, b"{}"), timeout_s=30):
                    deltas.append(delta)
            except Exception as exc:  # noqa: BLE001 - every failure is a lost request: the test reports it
                self.failures.append(exc)
                continue
            if [d.completion_tokens for d in deltas] != list(range(1, DELTAS + 1)) or not deltas[-1].finished:
                self.failures.append(AssertionError(f"request {request_id} got {deltas}"))
            self.completed += 1

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def replicas_come_and_go() -> None:
    ctx = zmq.asyncio.Context()
    first = FakeEngine(ctx, "tcp://127.0.0.1:*")
    port = int(first.router.socket.last_endpoint.decode().rsplit(":", 1)[1])
    a, b = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.2:{port}"
    records = Records("127.0.0.1")
    pool = EnginePool(ctx, resolve_all([f"tcp://{NAME}:{port}"], records.lookup), heartbeat_timeout_s=30)
    engines = [first]
    load = None
    try:
        await pool.connect(timeout_s=10)
        pool.start_heartbeat(0.05)
        pool.follow_dns([f"tcp://{NAME}:{port}"], interval_s=0.02, join_timeout_s=10, lookup=records.lookup)
        load = Load(pool, workers=4)
        await until(lambda: load.completed >= 5, "the load under way")

        # A pod appears: it joins once its handshake answers and takes requests.
        second = FakeEngine(ctx, b)
        engines.append(second)
        records.ips = ["127.0.0.1", "127.0.0.2"]
        await until(lambda: len(second.received) >= 3, "the new pod taking requests")

        # The first pod leaves the Service with generations still running on it.
        first.hold.clear()
        await until(lambda: first.held >= 1, "a generation held on the first pod")
        records.ips = ["127.0.0.2"]
        index = [r.address for r in pool.replicas].index(a)
        await until(lambda: index in pool.retired, "the first pod retired")
        cutoff = next(load.numbers)  # every request numbered later was routed after the retirement
        calls = records.calls
        await until(lambda: records.calls >= calls + 5, "five more discovery rounds")  # several discovery rounds later...
        assert pool.replicas[index].outstanding >= 1 and index in pool.retired  # ...still open for its own
        first.hold.set()
        await until(lambda: index in pool._free, "the retired pod closed")  # its generations done, it is closed
        first.stop()
        assert max(first.received) < cutoff, "a retired replica was sent new requests"

        # The pod comes back (a new process at the same address): it joins again, in the freed index.
        again = await bind_again(ctx, a)
        engines.append(again)
        records.ips = ["127.0.0.1", "127.0.0.2"]
        await until(lambda: len(again.received) >= 3, "the returned pod taking requests")
        assert [r.address for r in pool.replicas] == [a, b] and not pool.retired

        completed = load.completed
        await until(lambda: load.completed >= completed + 5, "the load going on")
        await load.stop()
        assert not load.failures, load.failures[:3]
    finally:
        if load is not None:
            await load.stop()
        await pool.close()
        for engine in engines:
            engine.stop()
        ctx.destroy(linger=0)  # also any socket a failed bind left open: term() would wait on it


def test_replicas_join_and_leave_while_requests_run_and_none_is_lost():
    asyncio.run(replicas_come_and_go())


async def lookup_fails_then_answers() -> None:
    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx, "tcp://127.0.0.1:*")
    port = int(engine.router.socket.last_endpoint.decode().rsplit(":", 1)[1])
    records = Records("127.0.0.1")
    pool = EnginePool(ctx, resolve_all([f"tcp://{NAME}:{port}"], records.lookup), heartbeat_timeout_s=30)
    try:
        await pool.connect(timeout_s=10)
        pool.start_heartbeat(0.05)
        records.ips = []  # every pod unready for a moment, or DNS unreachable
        pool.follow_dns([f"tcp://{NAME}:{port}"], interval_s=0.02, join_timeout_s=10, lookup=records.lookup)
        await until(lambda: records.calls >= 6, "six failing lookups")  # several rounds of failing lookups
        assert pool.candidates(set()) == [0] and not pool.retired
        records.ips = ["127.0.0.2"]  # an answer: the old address is retired and, idle, closed
        await until(lambda: 0 in pool._free, "the old address retired and closed")
        assert pool.replicas[0].stats is None  # a closed replica's last stats no longer count
    finally:
        await pool.close()
        engine.stop()
        ctx.destroy(linger=0)  # also any socket a failed bind left open: term() would wait on it


async def another_model_in_the_records() -> None:
    ctx = zmq.asyncio.Context()
    first = FakeEngine(ctx, "tcp://127.0.0.1:*")
    port = int(first.router.socket.last_endpoint.decode().rsplit(":", 1)[1])
    other = FakeEngine(ctx, f"tcp://127.0.0.2:{port}", model="another-model")  # a pod of a rollout's other side
    records = Records("127.0.0.1", "127.0.0.2")
    pool = EnginePool(ctx, resolve_all([f"tcp://{NAME}:{port}"], records.lookup)[:1], heartbeat_timeout_s=30)
    try:
        await pool.connect(timeout_s=10)
        pool.start_heartbeat(0.05)
        pool.follow_dns([f"tcp://{NAME}:{port}"], interval_s=0.02, join_timeout_s=10, lookup=records.lookup)
        await until(lambda: other.handshakes >= 1, "the other model's pod asked once")
        calls = records.calls
        await until(lambda: records.calls >= calls + 20, "twenty more discovery rounds")
        assert other.handshakes == 1 and [r.address for r in pool.replicas if r.up] == [f"tcp://127.0.0.1:{port}"]

        # The rollout ends: the old pod leaves the records with a generation still running on it. Nothing
        # in the set serves now, so the other model's pod is asked again at the next round, not after its back-off.
        first.hold.clear()
        stream = asyncio.create_task(anext(pool.generate(GenerateRequest("1", b"{}"), timeout_s=30)))
        await until(lambda: first.held >= 1, "a generation held on the old pod")
        records.ips = ["127.0.0.2"]
        calls = records.calls
        await until(lambda: other.handshakes >= 2 or records.calls >= calls + 20, "the other model's pod asked again")
        assert other.handshakes == 2, "a left-out pod waited out its back-off while nothing in the set served"
        first.hold.set()
        await stream
    finally:
        await pool.close()
        first.stop()
        other.stop()
        ctx.destroy(linger=0)


def test_a_replica_left_out_is_not_asked_again_at_every_discovery_round():
    """A pod of another model stays in the Service's records for a whole rollout: asked again only
    after a back-off (gateway/routing/replicas.py REJOIN_AFTER_S), not every round."""
    asyncio.run(another_model_in_the_records())


def test_a_failing_lookup_changes_nothing_and_the_next_answer_does():
    asyncio.run(lookup_fails_then_answers())


def test_a_retired_encoder_stays_open_while_a_route_holds_it(tmp_path):
    """Between a request's rounds (lookup, then pixels) nothing is outstanding,
    yet the route will send there again: the replica is not closed under it."""

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        addresses = [f"ipc://{tmp_path}/e{i}.sock" for i in range(2)]
        pool = EncoderPool(ctx, addresses, heartbeat_timeout_s=5)
        for replica in pool.replicas:
            replica.up = True
        try:
            with pool.route([b"img"]) as route:
                assert pool._enter(route)
                held = route.replica
                await pool.update([addresses[1 - held]], join_timeout_s=5)
                assert held in pool.retired and held not in pool._free
                assert pool.candidates(set()) == [1 - held]
            await pool.close_idle_retired()
            assert held in pool._free
        finally:
            await pool.close()
            ctx.destroy(linger=0)  # also any socket a failed bind left open: term() would wait on it

    asyncio.run(run())


def test_addresses_other_than_names_stand_for_themselves_and_names_for_every_record():
    records = Records("10.0.0.9", "10.0.0.7", "fd00::1")
    assert replica_addresses(f"tcp://{NAME}:5555", records.lookup) == [
        "tcp://10.0.0.7:5555", "tcp://10.0.0.9:5555", "tcp://[fd00::1]:5555"]
    for address in ("ipc:///tmp/e.sock", "tcp://10.1.2.3:5555", "tcp://[::1]:5555"):
        assert replica_addresses(address, records.lookup) == [address]
    with pytest.raises(OSError):
        replica_addresses("tcp://other.name:5555", records.lookup)


def test_a_dual_stack_name_resolves_to_its_ipv4_addresses(monkeypatch):
    """The services listen on tcp://0.0.0.0: a replica found at its IPv6 address would never answer."""
    answers = {"both": [(socket.AF_INET6, "fd00::7"), (socket.AF_INET, "10.0.0.7")], "v6-only": [(socket.AF_INET6, "fd00::8")]}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, type: [
        (family, socket.SOCK_STREAM, 6, "", (ip, port)) for family, ip in answers[host]])
    assert dns_lookup("both", 5555) == ["10.0.0.7"]
    assert dns_lookup("v6-only", 5555) == ["fd00::8"]
