"""Two encoder replicas over tcp:// on loopback, sharing a real Redis tier,
behind one gateway (a stack of their own): load spreads over both; one image
costs one encode however many requests want it; a replica's tokens are hits
on the other; Redis going away fails nothing; a replica killed under load
loses no request, and an engine finds a dead replica's tokens in Redis."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import numpy as np
import pytest
import torch
import zmq.asyncio

from testing.stack import LocalStack, free_port
from loadtest.synthetic import make_image
from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.to_gateway import EMBEDDINGS_UNAVAILABLE, EncodeResult, GatewayInbound, TokenDelta
from tests.integration.conftest import MODEL_NAME, ONE_PROCESS_ENGINE
from tests.integration.corpus import b64, save
from tests.integration.encoder_socket import encoder_stats, fetch_tokens, handshake, reply_to
from tests.integration.test_engine_guard import burst, burst_outcomes
from tests.integration.helpers import by_reference, child_pid, embeddings_request, log_records, scrape, send_raw, wait_until
from tests.integration.system import redis_server as start_redis

SIZES = [(256, 256), (640, 360), (960, 540), (1280, 720)]
ENCODER_FAILOVERS = ("prism_replica_failovers_total", (("service", "encoder"),))


@pytest.fixture(scope="module")
def redis_server():
    server = start_redis(free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, redis_server):
    overrides = {
        "PRISM_GATEWAY__STATS_INTERVAL_S": "0.5",
        "PRISM_GATEWAY__HEARTBEAT_TIMEOUT_S": "2",
        "PRISM_ENCODER__SHARED_CACHE_URL": redis_server.url,
        "PRISM_ENCODER__SHARED_CACHE_RETRY_S": "1",
        "PRISM_ENGINE__SHARED_CACHE_URL": redis_server.url,
        "PRISM_ENCODER__MAX_PIXELS": str(1280 * 720),
        "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256",
        "PRISM_ENGINE__SCHEDULING_POLICY": "priority",  # a deployment that trusts its clients' priorities
        **ONE_PROCESS_ENGINE,
    }
    stack = LocalStack(tmp_path_factory.mktemp("replicas"), overrides, encoder_replicas=2, transport="tcp")
    stack.start()
    yield stack
    stack.stop()


def per_replica(stack: LocalStack, name: str) -> list[float]:
    found = scrape(stack)
    return [found.get((name, (("model", MODEL_NAME), ("replica", str(i)))), 0.0) for i in range(2)]


def total_encoded(stack: LocalStack) -> int:
    """Images encoded by both replicas, asked of each (encoder_stats)."""
    return sum(encoder_stats(address).images_encoded for address in stack.encoder_addresses)


def chat(stack: LocalStack, image: str, max_tokens: int = 4) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)


def unique_images(prefix: str, count: int) -> list[str]:
    return [b64(save(make_image(f"{prefix}-{i}", SIZES[i % len(SIZES)]), "JPEG")) for i in range(count)]


def serve_all(stack: LocalStack, images: list[str], concurrency: int) -> list[int]:
    with ThreadPoolExecutor(concurrency) as pool:
        return [r.status_code for r in pool.map(lambda url: chat(stack, url), images)]



def test_mixed_load_spreads_over_both_replicas(replicated):
    before = per_replica(replicated, "prism_encoder_replica_requests_total")
    statuses = serve_all(replicated, unique_images("spread", 16), concurrency=8)
    assert statuses == [200] * 16
    sent = [after - b for after, b in zip(per_replica(replicated, "prism_encoder_replica_requests_total"), before)]
    assert all(count >= 3 for count in sent), f"requests per replica: {sent}"
    wait_until(lambda: all(n > 0 for n in per_replica(replicated, "prism_encoder_replica_images_encoded_total")), 5, "both replicas encoded")


def test_the_same_new_image_costs_one_encode_across_replicas(replicated):
    (image,) = unique_images("shared-by-16", 1)
    before = total_encoded(replicated)
    assert serve_all(replicated, [image] * 16, concurrency=16) == [200] * 16
    assert total_encoded(replicated) - before == 1


async def encode_on(address: str, request_id: str, digest: bytes, pixels: np.ndarray | None):
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        await handshake(socket)
        meta, frames = None, []
        if pixels is not None:
            meta, frame = to_frame(pixels)
            frames = [frame]
        await socket.send(EncodeRequest(request_id, [ImageInput(digest, meta)]), frames)
        reply, _ = await reply_to(socket, request_id)
        assert isinstance(reply, EncodeResult), reply
        (tokens,) = await fetch_tokens(ctx, address, reply.images)
        return reply.images[0], tokens
    finally:
        socket.close()
        ctx.term()


def test_tokens_encoded_on_one_replica_are_a_hit_on_the_other(replicated, redis_server):
    first, second = replicated.encoder_addresses
    pixels = np.random.default_rng(7).integers(0, 255, (112, 168, 3), dtype=np.uint8)
    digest = os.urandom(16)
    image, encoded = asyncio.run(encode_on(first, "on-first", digest, pixels))
    assert not image.cache_hit
    answers = []

    def found_by_digest():  # the write is asynchronous; ask by digest alone, as the gateway's first round does
        answers.append(from_shared_tier(second, digest))
        return answers[-1]

    wait_until(found_by_digest, 5, "the tokens written to the shared tier")
    image, shared = answers[-1]
    assert image.cache_hit and torch.equal(shared, encoded)


def test_a_redis_outage_fails_no_request_and_recovers(replicated, redis_server):
    redis_server.stop()

    def outage_seen_by_both() -> bool:
        # A replica meets the outage on a lookup of an image routed to it; the
        # replicas' ports, and so each image's replica, change from run to run.
        assert serve_all(replicated, unique_images(f"during-outage-{time.monotonic()}", 3), concurrency=3) == [200] * 3
        return per_replica(replicated, "prism_shared_cache_up") == [0.0, 0.0]

    try:
        wait_until(outage_seen_by_both, 30, "both replicas saw the outage", every_s=0.5)
        warnings = [r for r in log_records(replicated, "encoder") if "local cache only" in r.get("message", "")]
        assert warnings and all(r["level"] == "WARNING" for r in warnings)
    finally:
        redis_server.start()
    # Each replica probes again after its retry interval, on its next lookup or write.
    wait_until(lambda: serve_all(replicated, unique_images(f"after-outage-{time.monotonic()}", 2), 2) == [200, 200]
             and per_replica(replicated, "prism_shared_cache_up") == [1.0, 1.0], 30, "the shared tier came back")


def shared_events(stack: LocalStack, event: str) -> float:
    return scrape(stack).get(("prism_shared_cache_events_total", (("event", event),)), 0.0)


def test_redis_killed_and_restarted_under_load_fails_nothing_and_the_tier_reattaches(replicated, redis_server):
    reattached, written = shared_events(replicated, "reattach"), shared_events(replicated, "write")
    images = unique_images("redis-restart", 30)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(chat, replicated, url) for url in images]
        wait_until(lambda: sum(f.done() for f in futures) >= 6, 60, "load under way")
        redis_server.stop()  # SIGKILL
        wait_until(lambda: per_replica(replicated, "prism_shared_cache_up") == [0.0, 0.0], 10, "both replicas saw Redis go")
        redis_server.start()  # same port, empty
        statuses = [future.result().status_code for future in futures]
    assert statuses == [200] * len(images)
    # Each replica probes again after shared_cache_retry_s, on its next lookup or write.
    wait_until(lambda: serve_all(replicated, unique_images(f"after-restart-{time.monotonic()}", 2), 2) == [200, 200]
               and per_replica(replicated, "prism_shared_cache_up") == [1.0, 1.0], 30, "both replicas re-attached")
    assert shared_events(replicated, "reattach") >= reattached + 2  # the counters say so
    wait_until(lambda: shared_events(replicated, "write") > written, 5, "writes reach the restarted Redis")


def test_killing_a_replica_under_load_loses_no_request(replicated):
    images = unique_images("failover", 24)
    failovers = scrape(replicated)[ENCODER_FAILOVERS]
    with ThreadPoolExecutor(6) as pool:
        # Kill replica 0 while it holds requests. It encodes a demo image in a few
        # milliseconds, so one seen busy was sometimes idle by the time the kill
        # landed: stopped first, what it was sent stays outstanding until it dies.
        replica = child_pid(replicated, "vision_encoder", replicated.encoder_addresses[0])
        os.kill(replica, signal.SIGSTOP)
        futures = [pool.submit(chat, replicated, url, 8) for url in images]
        wait_until(lambda: per_replica(replicated, "prism_encoder_replica_outstanding")[0] > 0, 30, "requests on replica 0")
        os.kill(replica, signal.SIGKILL)
        statuses = [future.result().status_code for future in futures]
    assert statuses == [200] * len(images)
    assert scrape(replicated)[ENCODER_FAILOVERS] > failovers  # its requests went to the other
    recovered = wait_until(lambda: per_replica(replicated, "prism_encoder_replica_up") == [1.0, 1.0], 60, "the killed replica is back")
    print(f"killed replica back in service after {recovered:.1f} s")
    assert serve_all(replicated, unique_images("after-failover", 4), concurrency=4) == [200] * 4


def test_an_engine_fetches_a_dead_encoders_tokens_from_the_shared_tier(replicated, redis_server):
    first, second = replicated.encoder_addresses
    pixels = np.random.default_rng(8).integers(0, 255, (112, 168, 3), dtype=np.uint8)
    digest = os.urandom(16)
    image, _ = asyncio.run(encode_on(first, "left-behind", digest, pixels))
    wait_until(lambda: from_shared_tier(second, digest), 10, "the tokens written to the shared tier")
    os.kill(child_pid(replicated, "vision_encoder", first), signal.SIGKILL)
    answer = asyncio.run(send_raw(replicated.engine_addresses[0], by_reference(first, image, "from-redis")))
    assert isinstance(answer, TokenDelta) and answer.finished, answer
    wait_until(lambda: per_replica(replicated, "prism_encoder_replica_up") == [1.0, 1.0], 60, "the killed replica is back")


def from_shared_tier(address: str, digest: bytes):
    """What the other replica finds by digest alone (its own cache never had
    it): the image and its tokens, or None while the write has not landed."""
    try:
        return asyncio.run(encode_on(address, f"lookup-{time.monotonic()}", digest, None))
    except AssertionError:  # EncodeNeedsPixels: not written yet
        return None


def test_where_the_engine_schedules_by_priority_a_request_s_priority_is_served(replicated):
    """From the body or vLLM's header, through both encoders' queues and vLLM's scheduler: the same greedy answer."""
    image = b64(save(make_image("prioritised", (80, 60)), "PNG"))
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]

    def answer(headers: dict | None = None, **fields) -> str:
        body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": content}], **fields}
        response = httpx.post(f"{replicated.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    assert answer() == answer(priority=-2) == answer({"X-Vllm-Priority": "7"}, priority=-2)


def test_urgent_requests_past_a_full_engine_queue_take_the_least_urgent_places(replicated):
    """vLLM schedules by priority here. The queue (engine.max_waiting_requests) is filled with requests of
    priority 5 waiting for visual tokens that never come (a push promised by an encoder that is not
    there: after engine.embed_fetch_timeout_s, a 503 for the gateway to re-encode). Requests of priority
    -1 sent behind them are let in past the limit and served, each in the place of the latest of those,
    which is refused 429 "displaced" (a gateway tries it on another replica)."""
    waiting = [msgspec.structs.replace(embeddings_request(f"bulk-{index}", torch.randn(4, 128), (1, 4, 4))[0], priority=5)
               for index in range(256)]
    urgent = burst("urgent", 4, priority=-1)
    outcomes = asyncio.run(burst_outcomes(replicated.engine_addresses[0], waiting + urgent))
    assert [outcomes[request.request_id] for request in urgent] == ["ok"] * 4
    refused = collections.Counter(outcome for rid, outcome in outcomes.items() if rid.startswith("bulk"))
    assert refused == {(429, "displaced"): 4, (503, EMBEDDINGS_UNAVAILABLE): 252}
    assert {rid for rid, outcome in outcomes.items() if outcome == (429, "displaced")} == {f"bulk-{i}" for i in range(252, 256)}
    displaced = ("prism_displaced_requests_total", (("service", "engine"),))
    wait_until(lambda: scrape(replicated).get(displaced, 0) == 4, 10, "the engine's displaced requests in /metrics")
