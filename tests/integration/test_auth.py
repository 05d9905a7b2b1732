"""API keys and concurrency limits, on a second gateway process that shares the
session stack's encoder and engine (several gateways may connect to them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import httpx
import pytest

from common.config import REPO_ROOT
from testing.stack import free_port, serving
from tests.integration.conftest import MODEL_NAME
from tests.integration.helpers import wait_until

KEYS = ("key-alpha", "key-beta")


@pytest.fixture(scope="module")
def guarded(stack, tmp_path_factory):
    port = free_port()
    env = dict(
        os.environ,
        PRISM_GATEWAY__PORT=str(port),
        PRISM_GATEWAY__ENCODER_ADDRESSES=json.dumps(stack.encoder_addresses),
        PRISM_GATEWAY__ENGINE_ADDRESSES=json.dumps(stack.engine_addresses),
        PRISM_GATEWAY__API_KEYS=f"[{', '.join(KEYS)}]",
        PRISM_GATEWAY__MAX_CONCURRENT_REQUESTS_PER_KEY="1",
        PRISM_GATEWAY__MAX_CONCURRENT_REQUESTS="2",
    )
    log = open(tmp_path_factory.mktemp("guarded") / "gateway.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    with serving(process, f"http://127.0.0.1:{port}", 60) as base_url:
        yield base_url


def chat(base_url: str, key: str | None, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60, **kwargs)


@pytest.mark.parametrize("key,message", [(None, "missing API key"), ("key-gamma", "invalid API key"), ("key-alph", "invalid API key")])
def test_requests_without_a_valid_key_are_401(guarded, key, message):
    response = chat(guarded, key)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error" and message in response.json()["error"]["message"]


def test_a_valid_key_is_served_and_models_need_one_too(guarded):
    assert chat(guarded, "key-beta").status_code == 200
    assert httpx.get(f"{guarded}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{guarded}/v1/models", headers={"Authorization": "Bearer key-alpha"}, timeout=10).json()["data"][0]["id"] == MODEL_NAME


def gateway_in_flight(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = re.search(r'^prism_in_flight_requests\{service="gateway"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0  # no request admitted yet


class SlowUpload:
    """A request that holds its admission slot while its body trickles in."""

    def __init__(self, base_url: str, key: str) -> None:
        self.release = threading.Event()
        self.response: httpx.Response | None = None
        body = b'{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}' % MODEL_NAME.encode()

        def chunks():
            yield body[:10]
            self.release.wait(30)
            yield body[10:]

        def send():
            self.response = httpx.post(f"{base_url}/v1/chat/completions", content=chunks(), headers={"Authorization": f"Bearer {key}", "Content-Length": str(len(body))}, timeout=60)

        admitted = gateway_in_flight(base_url)
        self.thread = threading.Thread(target=send)
        self.thread.start()
        # the gateway takes the slot (and counts the request in flight) as the headers arrive, before the body
        wait_until(lambda: gateway_in_flight(base_url) > admitted, 10, f"a slow upload for {key} holding its slot")

    def finish(self) -> httpx.Response:
        self.release.set()
        self.thread.join(30)
        return self.response


def test_per_key_and_global_concurrency_limits_answer_429(guarded):
    alpha = SlowUpload(guarded, "key-alpha")
    try:
        refused = chat(guarded, "key-alpha")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "limit of 1 concurrent" in refused.json()["error"]["message"]
        beta = SlowUpload(guarded, "key-beta")  # another key: admitted, and the gateway is now full
        try:
            full = chat(guarded, "key-beta")
            assert full.status_code == 429 and "limit of 2 concurrent" in full.json()["error"]["message"]
        finally:
            assert beta.finish().status_code == 200
    finally:
        assert alpha.finish().status_code == 200
    assert chat(guarded, "key-alpha").status_code == 200  # slots were given back
