"""The encoder pool's routing rule: in-flight affinity, then last-served
affinity, then the image's own replica (rendezvous, bounded load); down or
refusing replicas are skipped."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from gateway.routing.encoder_pool import EncoderPool, Route
from gateway.routing.replicas import expand_addresses
from gateway.errors import APIError


@pytest.fixture
def pool(tmp_path):
    ctx = zmq.asyncio.Context()
    pool = EncoderPool(ctx, [f"ipc://{tmp_path}/e{i}.sock" for i in range(3)], heartbeat_timeout_s=5)
    for replica in pool.replicas:
        replica.up = True
    yield pool
    asyncio.run(pool.close())
    ctx.term()


def busy(pool: EncoderPool, index: int, requests: int) -> None:
    replica = pool.replicas[index]
    for n in range(replica.outstanding, replica.outstanding + requests):
        replica.open(f"busy-{index}-{n}")


def test_a_new_image_goes_to_the_same_replica_from_every_gateway_process(pool, tmp_path):
    """Rendezvous hashing: another process, which lists the replicas in another
    order and has routed nothing yet, picks the same address for each image."""
    ctx = zmq.asyncio.Context()
    other = EncoderPool(ctx, [r.address for r in reversed(pool.replicas)], heartbeat_timeout_s=5)
    for replica in other.replicas:
        replica.up = True
    try:
        chosen = {}
        for n in range(60):
            digest = f"image-{n}".encode()
            with pool.route([digest]) as mine, other.route([digest]) as theirs:
                pool._enter(mine)
                other._enter(theirs)
                assert pool.replicas[mine.replica].address == other.replicas[theirs.replica].address
                chosen[digest] = mine.replica
        assert set(chosen.values()) == {0, 1, 2}  # images spread over the replicas
    finally:
        asyncio.run(other.close())
        ctx.term()


def test_a_replica_past_its_bounded_load_is_passed_over(pool):
    with pool.route([b"a"]) as route:
        pool._enter(route)
        own = route.replica
    pool._last_served.clear()
    busy(pool, own, 3)  # the mean with this request is 4/3; 1.25 x that bounds a replica below 2
    with pool.route([b"a"]) as route:
        assert pool._enter(route) and route.replica != own
    pool._last_served.clear()
    busy(pool, (own + 1) % 3, 1)
    busy(pool, (own + 2) % 3, 1)  # mean 6/3: the bound is 3, still at it
    with pool.route([b"a"]) as route:
        assert pool._enter(route) and route.replica != own
    busy(pool, (own + 1) % 3, 1)
    busy(pool, (own + 2) % 3, 1)  # mean 8/3: the bound is 4, its own takes it again
    pool._last_served.clear()
    with pool.route([b"a"]) as route:
        assert pool._enter(route) and route.replica == own


def test_a_request_joins_the_replica_already_serving_its_image(pool):
    busy(pool, 2, 5)
    with pool.route([b"shared"]) as first:
        pool._enter(first)
        busy(pool, first.replica, 5)  # now the busiest, still chosen for the same image
        with pool.route([b"other", b"shared"]) as second:
            pool._enter(second)
            assert second.replica == first.replica


def test_a_request_goes_where_its_image_was_last_served(pool):
    with pool.route([b"img"]) as route:
        pool._enter(route)
        served = route.replica
    busy(pool, served, 3)
    with pool.route([b"img"]) as again:
        pool._enter(again)
        assert again.replica == served
    with pool.route([b"new"]) as fresh:
        pool._enter(fresh)
        assert fresh.replica != served


def test_down_and_refusing_replicas_are_skipped(pool):
    pool.replicas[0].up = False
    route = Route((b"a",), tried={1})
    assert pool._enter(route) and route.replica == 2
    pool._leave(route)
    route.tried.add(2)
    assert not pool._enter(route)


def test_affinity_does_not_pick_a_down_replica(pool):
    with pool.route([b"img"]) as route:
        pool._enter(route)
        served = route.replica
    pool.replicas[served].up = False
    with pool.route([b"img"]) as again:
        pool._enter(again)
        assert again.replica not in (None, served)


def test_nothing_up_is_a_503(pool):
    for replica in pool.replicas:
        replica.up = False
    with pytest.raises(APIError) as raised:
        pool.require_up()
    assert raised.value.status == 503 and raised.value.headers["Retry-After"]


def test_a_closed_pool_s_replicas_take_no_request_and_say_so_with_a_503(pool):
    """A reload's retired model closes its pools once its drain ends; a request of its still on
    its way (a failover, a first encode after a slow fetch) meets a 503 it may retry, not a closed socket."""
    from protocol.base import Hello

    idle = pool.replicas[0]
    asyncio.run(pool.close())
    assert not any(replica.up for replica in pool.replicas)
    idle.up = True  # a heartbeat's last word, come before the close
    with pytest.raises(APIError) as raised:
        asyncio.run(idle.send(Hello("gateway")))
    assert raised.value.status == 503 and "reloaded away" in raised.value.message


def test_a_host_name_becomes_one_replica_per_address():
    assert expand_addresses(["ipc:///tmp/a.sock", "tcp://10.0.0.7:5555", "tcp://[::1]:5555"]) == [
        "ipc:///tmp/a.sock", "tcp://10.0.0.7:5555", "tcp://[::1]:5555"]
    local = expand_addresses(["tcp://localhost:5555"])
    assert local and all(a.startswith("tcp://") and a.endswith(":5555") for a in local)
    assert "tcp://127.0.0.1:5555" in local
    assert expand_addresses(["tcp://127.0.0.1:5555", "tcp://localhost:5555"]).count("tcp://127.0.0.1:5555") == 1


def test_a_replica_that_refused_an_image_is_not_remembered_as_holding_it(pool, monkeypatch):
    """Every encoder full (429): the image was encoded nowhere, so a repeat must come with its pixels,
    not by digest (which costs an EncodeNeedsPixels round)."""
    from protocol.to_encoder import EncodeRequest

    async def full(*_args, **_kwargs):
        raise APIError(429, "encoder queue is full", headers={"Retry-After": "1"})

    for replica in pool.replicas:
        monkeypatch.setattr(replica, "ask", full)

    async def ask() -> None:
        with pool.route([b"refused-everywhere"]) as route:
            await pool.ask(route, EncodeRequest("r", []), [], timeout_s=1)

    with pytest.raises(APIError):
        asyncio.run(ask())
    assert not pool.routed(b"refused-everywhere")
