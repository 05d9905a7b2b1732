"""Every error the gateway answers is in OpenAI's shape, Starlette's own included, and a
model is looked up by id as OpenAI's SDK does (`client.models.retrieve`)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from gateway.api.app import create_app
from gateway.config import GatewayConfig
from protocol.to_gateway import EngineReady


def client() -> TestClient:
    app = create_app(GatewayConfig())
    # a routing map's entry: its name, and its engines' handshake (a card's root and context length)
    app.state.gateway.models["m"] = SimpleNamespace(engine=SimpleNamespace(info=EngineReady("checkpoint-m", 4096)))
    return TestClient(app)


def test_an_unknown_path_or_method_is_an_openai_error():
    for method, path, status in (("POST", "/v1/completions", 404), ("GET", "/v1/chat/completions", 405)):
        response = client().request(method, path)
        error = response.json()["error"]
        assert response.status_code == status and error["type"] == "invalid_request_error" and path in error["message"]


def test_a_model_is_retrieved_by_its_id():
    card = client().get("/v1/models/m").json()
    assert card == {"id": "m", "object": "model", "created": card["created"], "owned_by": "prism", "root": "checkpoint-m",
                    "parent": None, "max_model_len": 4096} and card["created"] > 0
    assert client().get("/v1/models/").json()["data"][0]["id"] == "m"
    missing = client().get("/v1/models/gpt-nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_browser_s_preflight_is_answered_for_the_origins_configured_and_no_other():
    """A web page on another origin sends an OPTIONS first (its Authorization header is not a simple one)."""
    import pydantic
    import pytest

    headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
    allowed = TestClient(create_app(GatewayConfig(cors_allowed_origins=("https://app.example",))))
    preflight = allowed.options("/v1/chat/completions", headers=headers)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    unlisted = TestClient(create_app(GatewayConfig())).options("/v1/chat/completions", headers=headers)
    assert "access-control-allow-origin" not in unlisted.headers  # none by default: the browser refuses
    for bad in (("https://app.example/",), ("app.example",), ("*", "https://app.example")):
        with pytest.raises(pydantic.ValidationError, match="origin"):
            GatewayConfig(cors_allowed_origins=bad)
