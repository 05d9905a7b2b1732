"""The load tester's request on the wire: the body serialised with msgspec
(loadtest/client.py), read back as the JSON the standard library would send."""

from __future__ import annotations

import asyncio
import json

import httpx

from loadtest.client import Target, chat_body, send
from loadtest.workload import ImageSpec, RequestSpec

URL = "data:image/jpeg;base64," + "A" * 300_000 + "é\"\\"  # long, and with characters JSON escapes


def test_the_body_is_the_chat_request_as_json() -> None:
    seen: list[httpx.Request] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})

    target = Target("http://prism.test", "demo", api_key="secret", stream=False)
    request = RequestSpec(0, (ImageSpec("small", 32, 32, "JPEG", 1),), "What is this?", None, 4)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await send(client, target, request, [URL])

    result = asyncio.run(run())
    assert result.error is None
    (sent,) = seen
    assert json.loads(sent.content) == chat_body(target, request, [URL])
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["authorization"] == "Bearer secret"
