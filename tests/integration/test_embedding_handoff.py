"""Visual tokens go from encoder to engine, never through the gateway
(llm_engine/images.py): the gateway carries keys; the encoder pushes a new
image's tokens to the request's engine as it encodes them, or the engine
fetches them from the encoder that holds them; the engine keeps recent ones in
its own LRU, and a lost tensor costs one re-encode or a 503, never a hang.

Beside the session stack, this module starts encoders of its own (one to kill,
one that keeps nothing) and a gateway on the second; both encoders hand their
references to the session stack's engine, which fetches from any encoder a
reference names.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys

import httpx
import pytest

from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL
from testing.stack import free_port, wait_for_health
from loadtest.clips import clip
from loadtest.synthetic import make_image
from protocol.to_gateway import EMBEDDINGS_UNAVAILABLE, GenerateFailed, TokenDelta
from tests.integration.conftest import MODEL_NAME
from tests.integration.corpus import b64, save
from tests.integration.encoder_socket import encode_directly, encoder_process
from tests.integration.helpers import by_reference, scrape, send_raw, wait_until

SERVICE = dict(os.environ, PRISM_MODEL=str(RANDOM_MODEL), PRISM_ENCODER__DTYPE="float32")


def spawn(module: str, log, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module], cwd=REPO_ROOT, env=dict(SERVICE, **env),
                            stdout=log, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("handoff")


@pytest.fixture(scope="module")
def forgetful(stack, run_dir):
    """A gateway whose encoder keeps nothing it hands out: no cache, and each
    reference's pin expires as the reply leaves, so every fetch misses."""
    port = free_port()
    with encoder_process(run_dir, name="forgetful", PRISM_ENCODER__DTYPE="float32", PRISM_ENCODER__CACHE_CAPACITY_MB="0",
                         PRISM_ENCODER__HANDOFF_TTL_S="0.000001") as encoder:
        gateway = spawn("gateway", open(run_dir / "forgetful-gateway.log", "wb"), PRISM_GATEWAY__PORT=str(port),
                        PRISM_GATEWAY__PUSH_EMBEDDINGS="false",  # else the engine has the tokens before it could miss them
                        PRISM_GATEWAY__ENCODER_ADDRESSES=f"[{encoder.address}]",
                        PRISM_GATEWAY__ENGINE_ADDRESSES=f"[{stack.engine_addresses[0]}]")
        try:
            wait_for_health(f"http://127.0.0.1:{port}", gateway, 120)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(gateway)


def image_body(name: str, size=(320, 240)) -> dict:
    url = b64(save(make_image(name, size), "PNG"))
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def moved(samples: dict) -> float:
    """Token bytes that reached the engine from encoders: fetched or pushed."""
    return metric(samples, "prism_engine_fetched_bytes_total") + metric(samples, "prism_engine_pushed_bytes_total")


def ask(stack, name: str) -> None:
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=image_body(name), timeout=60)
    assert response.status_code == 200, response.text


def test_the_gateway_carries_references_and_a_repeated_image_moves_no_bytes(stack):
    before = scrape(stack)
    images = 4
    for i in range(images):
        ask(stack, f"by-reference-{i}")
    reached = ("fetched", "pushed")
    wait_until(lambda: sum(delta(before, scrape(stack), "prism_engine_embeddings_total", source=s) for s in reached) >= images,
               10, "the tokens the engine received, in its stats")
    after = scrape(stack)
    tokens = moved(after) - moved(before)
    from_encoder = delta(before, after, "prism_gateway_peer_bytes_total", peer="encoder", direction="received")
    to_engine = delta(before, after, "prism_gateway_peer_bytes_total", peer="engine", direction="sent")
    # The tokens crossed encoder → engine once; the gateway's replies from the
    # encoder (heartbeats included) hold a fraction of them.
    assert tokens > 0 and from_encoder < tokens / 4, (tokens, from_encoder)
    assert to_engine < tokens, (to_engine, tokens)
    # New images went to the encoder (so the check on the repeat below reads a live counter).
    assert delta(before, after, "prism_encoder_replica_requests_total", model=MODEL_NAME, replica="0") >= images

    ask(stack, "by-reference-0")
    wait_until(lambda: delta(after, scrape(stack), "prism_engine_embeddings_total", source="engine_cache") > 0, 10,
               "a hit in the engine's LRU")
    repeated = scrape(stack)
    assert moved(repeated) == moved(after)
    # The gateway sent the reference it kept from the first encode
    # (gateway/routing/handoff.py, Delivery.KNOWN): no encoder was asked.
    assert delta(after, repeated, "prism_gateway_images_by_known_reference_total") == 1
    assert delta(after, repeated, "prism_encoder_replica_requests_total", model=MODEL_NAME, replica="0") == 0


def settled(stack) -> dict:
    """A scrape once the services' heartbeats (1 s) have caught up: two in a
    row, more than a heartbeat apart, agree on every handoff counter."""
    previous: list[dict] = [{}]

    def agree() -> bool:
        samples = scrape(stack)
        counters = {k: v for k, v in samples.items() if "push" in k[0] or "fetch" in k[0] or k[0] == "prism_engine_embeddings_total"}
        same, previous[0] = counters == previous[0], counters
        return same

    wait_until(agree, 15, "the handoff counters settled", every_s=1.5)
    return scrape(stack)


def test_new_images_tokens_are_pushed_to_the_engine_and_never_fetched(stack):
    ask(stack, "push-warm-up")  # the encoder's connection to the engine is up after its first push
    before = settled(stack)
    images = 3
    for i in range(images):
        ask(stack, f"pushed-{i}")

    def counted(samples: dict) -> bool:  # the engine's and the encoder's heartbeats both in
        return (delta(before, samples, "prism_engine_embeddings_total", source="pushed") >= images
                and delta(before, samples, "prism_encoder_pushes_total", outcome="sent") >= images)

    wait_until(lambda: counted(scrape(stack)), 10, "the engine used each image's pushed tokens")
    after = scrape(stack)
    assert delta(before, after, "prism_engine_embeddings_total", source="pushed") == images
    assert delta(before, after, "prism_encoder_pushes_total", outcome="sent") == images
    assert delta(before, after, "prism_engine_embeddings_total", source="fetched") == 0
    assert delta(before, after, "prism_engine_fetched_bytes_total") == 0
    assert delta(before, after, "prism_engine_pushed_bytes_total") > 0


def test_an_encoder_killed_between_encode_and_fetch_fails_the_request_with_503_not_a_hang(stack, run_dir):
    engine = stack.engine_addresses[0]
    with encoder_process(run_dir, name="doomed", PRISM_ENCODER__DTYPE="float32") as doomed:
        address = doomed.address
        reply = asyncio.run(encode_directly(address, ["doomed-a", "doomed-b"]))
        fetched = asyncio.run(send_raw(engine, by_reference(address, reply.images[0], "handoff-alive")))
        assert isinstance(fetched, TokenDelta) and fetched.finished, fetched  # the engine fetched it from this encoder
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(10)
        failed = asyncio.run(send_raw(engine, by_reference(address, reply.images[1], "handoff-dead")))
        assert isinstance(failed, GenerateFailed), failed
        assert (failed.status, failed.code) == (503, EMBEDDINGS_UNAVAILABLE) and "engine.embed_fetch_timeout_s" in failed.message
    healthy = httpx.post(f"{stack.base_url}/v1/chat/completions", json=image_body("after-the-kill"), timeout=60)
    assert healthy.status_code == 200


def encodes(gateway: str) -> float:
    return sum(v for (name, _), v in scrape(gateway).items() if name == "prism_encoder_replica_images_encoded_total")


def settled_encodes(gateway: str) -> float:
    """The encode count once two scrapes more than a heartbeat (1 s) apart agree: one more encode,
    not yet in the stats the gateway polls, would show by then."""
    counts: list[float] = []

    def agree() -> bool:
        counts.append(encodes(gateway))
        return len(counts) > 1 and counts[-1] == counts[-2]

    wait_until(agree, 15, "the encode count settled", every_s=1.5)
    return counts[-1]


def test_tokens_lost_before_the_fetch_are_encoded_once_more_then_503(forgetful):
    before = encodes(forgetful)
    response = httpx.post(f"{forgetful}/v1/chat/completions", json=image_body("forgotten"), timeout=60)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == EMBEDDINGS_UNAVAILABLE and response.headers["Retry-After"]
    wait_until(lambda: encodes(forgetful) - before >= 2, 10, "the image encoded twice: once more after the lost fetch")
    assert settled_encodes(forgetful) - before == 2  # and no more
    # Its references were forgotten: asked again, the gateway goes to the encoder, not by a stale reference.
    known = metric(scrape(forgetful), "prism_gateway_images_by_known_reference_total")
    assert httpx.post(f"{forgetful}/v1/chat/completions", json=image_body("forgotten"), timeout=60).status_code == 503
    wait_until(lambda: encodes(forgetful) - before == 4, 10, "encoded twice more")
    assert metric(scrape(forgetful), "prism_gateway_images_by_known_reference_total") == known
    text = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{forgetful}/v1/chat/completions", json=text, timeout=60).status_code == 200


def test_a_video_s_lost_tokens_are_decoded_and_encoded_once_more_then_503(forgetful):
    """The re-encode of a video decodes it again from the bytes the request kept: asked by key first
    (this gateway routed it), missing (the encoder keeps nothing), then its frames."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(clip(seed=4603)).decode()}},
        {"type": "text", "text": "What moves?"}]}]}
    before = encodes(forgetful)
    response = httpx.post(f"{forgetful}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == EMBEDDINGS_UNAVAILABLE
    wait_until(lambda: encodes(forgetful) - before >= 2, 10, "the video encoded twice: once more after the lost fetch")
    assert settled_encodes(forgetful) - before == 2  # and no more
