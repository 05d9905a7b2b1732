"""The engine replica an encoder pushes a request's visual tokens to is the one
the request is sent to first; a replica it fails over to is told that no push
is coming (it fetches at once). Real EnginePool and DEALER/ROUTER sockets;
the two 'engines' answer by hand, the first pick refusing as a draining
engine does."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from gateway.engine_pool import EnginePool
from protocol.tensors import ArrayMeta
from protocol.to_engine import GenerateRequest, ImageEmbedding
from protocol.to_gateway import ChoiceDelta, GenerateFailed, TokenDelta
from tests.unit.by_hand import EngineByHand

DIGEST = b"\x05" * 16


class Engine(EngineByHand):
    def __init__(self, ctx: zmq.asyncio.Context, address: str, takes_pushes: bool) -> None:
        super().__init__(ctx, address)
        self.takes_pushes = takes_pushes
        self.refuse = False
        self.received: list[GenerateRequest] = []

    def answer(self, message):
        if not isinstance(message, GenerateRequest):
            return None
        self.received.append(message)
        if self.refuse:
            return GenerateFailed(message.request_id, "engine is draining", 503, "engine_draining")
        return TokenDelta(message.request_id, [ChoiceDelta(0, "x")], 1, 1, finished=True)


def pushed_request(pushed: bool) -> GenerateRequest:
    image = ImageEmbedding(ArrayMeta("bfloat16", (4, 8)), None, b"k", "tcp://encoder", b"id", pushed)
    return GenerateRequest("r", b"{}", [image])


async def _route(tmp_path, takes_pushes: bool) -> tuple[int | None, list[Engine]]:
    ctx = zmq.asyncio.Context()
    engines = [Engine(ctx, f"ipc://{tmp_path}/engine-{i}.sock", takes_pushes) for i in range(2)]
    pool = EnginePool(ctx, [f"ipc://{tmp_path}/engine-{i}.sock" for i in range(2)], heartbeat_timeout_s=30)
    try:
        await pool.connect(timeout_s=5)
        target = pool.push_target([DIGEST])
        if target is not None:
            engines[target].refuse = True
        request = pushed_request(target is not None)
        deltas = [delta async for delta in pool.generate(request, 5, [DIGEST], target)]
        assert deltas[-1].finished
        return target, engines
    finally:
        await pool.close()
        for engine in engines:
            engine.stop()
        ctx.destroy(linger=0)


def test_the_pushed_replica_is_tried_first_and_a_failover_is_told_to_fetch(tmp_path):
    target, engines = asyncio.run(_route(tmp_path, takes_pushes=True))
    assert target is not None
    first, other = engines[target], engines[1 - target]
    assert [r.images[0].pushed for r in first.received] == [True]  # it refused, as a draining engine does
    assert [r.images[0].pushed for r in other.received] == [False]  # no push is coming there: it fetches


def test_no_push_is_asked_of_engines_that_keep_none(tmp_path):
    target, engines = asyncio.run(_route(tmp_path, takes_pushes=False))
    assert target is None
    assert [r.images[0].pushed for e in engines for r in e.received] == [False]
