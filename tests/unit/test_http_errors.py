"""Every error the gateway answers is in OpenAI's shape, Starlette's own included, and a
model is looked up by id as OpenAI's SDK does (`client.models.retrieve`)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from gateway.api.app import create_app
from gateway.config import GatewayConfig


def client() -> TestClient:
    app = create_app(GatewayConfig())
    app.state.gateway.models["m"] = object()  # a routing map's entry: only its name is read here
    return TestClient(app)


def test_an_unknown_path_or_method_is_an_openai_error():
    for method, path, status in (("POST", "/v1/completions", 404), ("GET", "/v1/chat/completions", 405)):
        response = client().request(method, path)
        error = response.json()["error"]
        assert response.status_code == status and error["type"] == "invalid_request_error" and path in error["message"]


def test_a_model_is_retrieved_by_its_id():
    assert client().get("/v1/models/m").json() == {"id": "m", "object": "model", "created": 0, "owned_by": "prism"}
    assert client().get("/v1/models/").json()["data"][0]["id"] == "m"
    missing = client().get("/v1/models/gpt-nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
