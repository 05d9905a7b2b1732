"""The encoder pool's routing rule: in-flight affinity, then last-served
affinity, then least outstanding; down or refusing replicas are skipped."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from gateway.encoder_pool import EncoderPool, Route
from gateway.replicas import expand_addresses
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
    for n in range(requests):
        pool.replicas[index].open(f"busy-{index}-{n}")


def test_least_outstanding_wins(pool):
    busy(pool, 0, 2)
    busy(pool, 1, 1)
    busy(pool, 2, 3)
    with pool.route([b"a"]) as route:
        assert pool._enter(route) and route.replica == 1


def test_ties_rotate(pool):
    picked = set()
    for _ in range(3):
        with pool.route([b"x"]) as route:
            pool._enter(route)
            picked.add(route.replica)
        pool._last_served.clear()
    assert picked == {0, 1, 2}


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


def test_a_host_name_becomes_one_replica_per_address():
    assert expand_addresses(["ipc:///tmp/a.sock", "tcp://10.0.0.7:5555", "tcp://[::1]:5555"]) == [
        "ipc:///tmp/a.sock", "tcp://10.0.0.7:5555", "tcp://[::1]:5555"]
    local = expand_addresses(["tcp://localhost:5555"])
    assert local and all(a.startswith("tcp://") and a.endswith(":5555") for a in local)
    assert "tcp://127.0.0.1:5555" in local
    assert expand_addresses(["tcp://127.0.0.1:5555", "tcp://localhost:5555"]).count("tcp://127.0.0.1:5555") == 1
