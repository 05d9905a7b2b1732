"""The load tester's request on the wire: the body serialised with msgspec
(loadtest/client.py), read back as the JSON the standard library would send."""

from __future__ import annotations

import asyncio
import dataclasses
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


def _sent_to(server, stream: bool = True, due: float | None = None):
    target = Target("http://prism.test", "demo", stream=stream)
    request = RequestSpec(0, (), "hi", None, 4)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await send(client, target, request, [], due)

    return asyncio.run(run())


def test_an_answer_not_in_the_api_s_shape_is_that_request_s_error_not_the_run_s_end() -> None:
    """A proxy's HTML page in a stream, a body of no JSON: one failed request, the others' results kept."""
    html = _sent_to(lambda _: httpx.Response(200, text="data: <html>bad gateway</html>\n\n"))
    assert html.error == "bad_response_JSONDecodeError" and not html.ok
    body = _sent_to(lambda _: httpx.Response(200, text="<html>"), stream=False)
    assert body.error == "bad_response_JSONDecodeError"


def test_an_open_loop_request_is_timed_from_when_it_was_due() -> None:
    """A client that fell behind its schedule (its loop busy) sends late: the wait is the user's too."""
    import time

    chunk = 'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\ndata: [DONE]\n\n'
    result = _sent_to(lambda _: httpx.Response(200, text=chunk), due=time.perf_counter() - 1.0)
    assert result.ttft_s >= 1.0  # a lower bound: the second it was late


def test_a_request_s_priority_is_sent_only_where_it_is_set():
    target = Target("http://prism.test", "demo")
    request = RequestSpec(0, (ImageSpec("small", 32, 32, "JPEG", 1),), "What is this?", None, 4)
    assert "priority" not in chat_body(target, request, [URL])
    assert chat_body(target, dataclasses.replace(request, priority=-1), [URL])["priority"] == -1
