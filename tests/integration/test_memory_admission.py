"""Admission by memory (gateway/intake/memory.py), on gateways of their own that
share the session stack's encoder and engine: one told its memory limit by
config, and one started inside a memory cgroup (as in a container), which
takes a burst of 4K uploads that would take it past its limit if admitted."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import httpx
import pytest

from bench.cgroup import MemoryCgroup
from bench.uploads import Uploads, burst, by_outcome, large_jpeg
from common.config import REPO_ROOT
from testing.stack import free_port, scrape, serving
from tests.integration.conftest import MODEL_NAME
from tests.integration.helpers import wait_until

MIB = 2**20
CAP = 1536 * MIB  # the capped gateway's cgroup limit: about 0.55 GB of its own, the rest for requests
BURST = 150  # 4K uploads at once: admitted all, they would hold about 2 GB


def gateway(stack, log, preexec=None, **overrides: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PRISM_GATEWAY__PORT=str(port), PRISM_GATEWAY__STATS_INTERVAL_S="0.5",
               PRISM_GATEWAY__ENCODER_ADDRESSES=json.dumps(stack.encoder_addresses),
               PRISM_GATEWAY__ENGINE_ADDRESSES=json.dumps(stack.engine_addresses), **overrides)
    process = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env=env, stdout=open(log, "wb"),
                               stderr=subprocess.STDOUT, preexec_fn=preexec)
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tight(stack, tmp_path_factory):
    """1.25 GiB: a budget of a few hundred MB, read from /metrics by the tests."""
    log = tmp_path_factory.mktemp("tight") / "gateway.log"
    process, url = gateway(stack, log, PRISM_GATEWAY__MEMORY_LIMIT_BYTES="1.25GiB", PRISM_GATEWAY__MAX_BODY_BYTES=str(2**30))
    with serving(process, url, 120) as base_url:
        yield base_url


def metric(base_url: str, name: str) -> float:
    return scrape(base_url)[(name, ())]


def headers_only(base_url: str, length: int, expect: bool = False) -> socket.socket:
    """A POST whose headers declare `length` bytes of body, none of which is
    sent; with `expect`, as curl sends a large body: only once told to continue."""
    port = int(base_url.rsplit(":", 1)[1])
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: prism\r\nContent-Type: application/json\r\n"
                 b"%sContent-Length: %d\r\n\r\n" % (b"Expect: 100-continue\r\n" if expect else b"", length))
    return conn


def answer(conn: socket.socket) -> tuple[str, dict[str, str], dict]:
    """The response's status line, headers and JSON body (a failure if none comes in 30 s)."""
    conn.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536) or pytest.fail(f"connection closed after {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += conn.recv(65536)
    return status, headers, json.loads(body)


def chat_with_image(base_url: str) -> httpx.Response:
    from loadtest.synthetic import data_url, make_image

    content = [{"type": "image_url", "image_url": {"url": data_url(make_image("memory", (640, 480)))}},
               {"type": "text", "text": "What is it?"}]
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)


def test_a_body_there_is_no_room_for_is_refused_before_it_is_sent(tight):
    budget = metric(tight, "prism_gateway_memory_budget_bytes")
    assert budget > 100 * MIB
    holder = headers_only(tight, int(0.3 * budget))  # admitted: 0.6 of the budget counted for it
    holder.sendall(b'{"model": "')
    counted = 2 * int(0.3 * budget)
    wait_until(lambda: metric(tight, "prism_gateway_memory_held_bytes") == counted, 10, "the first body counted")
    with headers_only(tight, int(0.1 * budget), expect=True) as refused:
        status, headers, body = answer(refused)  # not a byte of its body was sent, nor asked for (no 100 Continue)
    assert status.startswith("HTTP/1.1 429") and headers["retry-after"] == "1"
    assert body["error"]["code"] == "memory_full" and "retry shortly" in body["error"]["message"]
    with headers_only(tight, int(0.4 * budget)) as never:
        status, _, body = answer(never)
    assert status.startswith("HTTP/1.1 413") and "admits at most" in body["error"]["message"]
    holder.close()  # the client hangs up mid-upload: its bytes are given back, and it is a request it closed
    wait_until(lambda: metric(tight, "prism_gateway_memory_held_bytes") == 0, 10, "the held bytes given back")
    assert chat_with_image(tight).status_code == 200
    outcomes = {dict(labels)["status"]: value for (name, labels), value in scrape(tight).items() if name == "prism_requests_total"}
    assert outcomes.get("499") == 1 and "500" not in outcomes, outcomes


def test_a_body_without_content_length_is_counted_as_it_arrives(tight):
    budget = metric(tight, "prism_gateway_memory_budget_bytes")
    piece = b" " * MIB

    def pieces():  # no Content-Length: chunked, more than a request may hold
        yield b'{"model": "' + MODEL_NAME.encode() + b'", "messages": [], "x": "'
        for _ in range(int(budget / 2 / MIB)):
            yield piece
        yield b'"}'

    response = httpx.post(f"{tight}/v1/chat/completions", content=pieces(), timeout=120)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert "sent without Content-Length" in response.json()["error"]["message"]
    wait_until(lambda: metric(tight, "prism_gateway_memory_held_bytes") == 0, 10, "the held bytes given back")
    assert chat_with_image(tight).status_code == 200


@pytest.fixture(scope="module")
def capped(stack, tmp_path_factory):
    if not MemoryCgroup.available():
        pytest.skip("making a memory cgroup needs root and cgroup v1, or v2 with the memory controller")
    cgroup = MemoryCgroup(f"prism-test-{os.getpid()}", CAP)
    process, url = gateway(stack, tmp_path_factory.mktemp("capped") / "gateway.log", cgroup.enter)
    try:
        with serving(process, url, 120) as base_url:
            yield process, cgroup, base_url
    finally:
        process.wait(30)
        cgroup.remove()


def test_a_burst_of_4k_uploads_in_a_memory_cgroup_is_answered_and_the_gateway_lives(capped):
    process, cgroup, base_url = capped
    budget = metric(base_url, "prism_gateway_memory_budget_bytes")
    assert budget < CAP * 0.8  # sized from the cgroup's limit, not the machine's memory
    uploads = Uploads.of(large_jpeg(), MODEL_NAME, "capped", max_tokens=2)
    answers = by_outcome(asyncio.run(burst(base_url, uploads, BURST)))
    print(f"\n{BURST} 4K uploads at once under a {CAP // MIB} MiB cgroup: {answers}; "
          f"cgroup peak {cgroup.peak // MIB} MiB")
    assert process.poll() is None and cgroup.oom_kills == 0
    assert set(answers) <= {"200", "429", "503"} and answers.get("200", 0) > 0, answers
    wait_until(lambda: metric(base_url, "prism_gateway_memory_held_bytes") == 0, 30, "every request's bytes given back")
