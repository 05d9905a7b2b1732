"""A failure of the gateway's own (a bug, not the input) is answered in OpenAI's error shape, or
ends a started stream with an error event, and is counted like every other outcome: a bare
Starlette 500 was never in `prism_requests_total` and a stream's was counted as the client
hanging up. The app runs without its lifespan (no services to handshake with); the served
model is a stand-in whose pipeline fails where a bug would."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from gateway.api.app import create_app
from gateway.config import GatewayConfig
from protocol.to_gateway import ChoiceDelta, TokenDelta


class FailingPipeline:
    def __init__(self, before_first_token: bool) -> None:
        self.before_first_token = before_first_token

    async def prepare(self, request, record):
        if self.before_first_token:
            raise RuntimeError("a bug before the first token")
        return request

    async def generate(self, prepared, timer):
        yield TokenDelta("r", [ChoiceDelta(0, "Hel", tokens=1)], completion_tokens=1, prompt_tokens=3)
        raise RuntimeError("a bug mid-stream")


class StandInModel:
    name = "m"

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass


def internal_errors() -> float:
    return REGISTRY.get_sample_value("prism_requests_total", {"status": "500", "reason": "internal_error"}) or 0.0


def client_with(pipeline) -> TestClient:
    app = create_app(GatewayConfig())
    app.state.gateway.models["m"] = StandInModel(pipeline)
    return TestClient(app, raise_server_exceptions=False)


CHAT = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def test_a_failure_before_the_response_is_an_openai_error_and_counted():
    before = internal_errors()
    response = client_with(FailingPipeline(before_first_token=True)).post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert response.headers["x-request-id"].startswith("chatcmpl-")
    assert internal_errors() == before + 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_failure_after_the_first_token_is_counted_as_the_gateway_s(stream):
    before = internal_errors()
    response = client_with(FailingPipeline(before_first_token=False)).post("/v1/chat/completions", json={**CHAT, "stream": stream})
    if stream:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert json.loads(events[1])["choices"][0]["delta"]["content"] == "Hel"
        assert json.loads(events[-2])["error"]["code"] == "internal_error"
        assert events[-1] == "[DONE]"
    else:
        assert (response.status_code, response.json()["error"]["code"]) == (500, "internal_error")
    assert internal_errors() == before + 1
