"""Bad requests get a clear error in OpenAI's shape, and the service keeps serving.

Image-level bad input is covered by the corpus in test_intake.py."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from tests.integration.conftest import MODEL_NAME


def png_url(size=(64, 48)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


BAD_REQUESTS = [
    ("unsupported-field", body(best_of=2), 400, "best_of"),
    ("tool-without-function", body(tools=[{"type": "function"}]), 422, "function"),
    ("temperature", body(temperature=5), 422, "temperature"),
    ("max-tokens-zero", body(max_tokens=0), 422, "max_tokens"),
    ("min-over-max-tokens", body(min_tokens=5), 422, "min_tokens (5) exceeds max_tokens (2)"),
    ("no-messages", body(messages=[]), 422, "messages"),
    ("empty-stop", body(stop=[""]), 422, "stop sequences must not be empty"),
    ("bad-role", body(messages=[{"role": "robot", "content": "x"}]), 422, "role"),
    ("unknown-model", body(model="gpt-nothing"), 404, "gpt-nothing"),
    ("unresolvable-host", body(messages=image_message("https://no-such-host.invalid/cat.png")), 400, "cannot resolve host"),
    ("too-many-images", body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url()}}] * 9}]), 400, "limit is 8"),
    ("prompt-too-long", body(max_tokens=4096), 400, "max"),
]


@pytest.mark.parametrize("payload,status,needle", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_clear_error_then_service_still_serves(stack, payload, status, needle):
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    ok = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(messages=image_message(png_url())), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_malformed_json_is_400(stack):
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_fields_that_change_nothing_are_accepted(stack):
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(user="u-1", metadata={"k": "v"}, store=False), timeout=60)
    assert response.status_code == 200
