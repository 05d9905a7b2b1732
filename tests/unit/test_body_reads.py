"""uvicorn reads a whole request body without waiting for the app
(gateway/api/parsing.py `buffer_whole_bodies`): a real uvicorn server, real HTTP;
and `read_body` hands on a body that came in one piece without copying it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvicorn
from starlette.requests import Request
from uvicorn.protocols.http import h11_impl, httptools_impl

from gateway.api.parsing import buffer_whole_bodies, read_body
from testing.stack import free_port
from tests.waiting import wait_until_async

BODY = b"x" * (2 * 2**20)  # about a 4K JPEG's request, twice over


async def first_piece(request_scope, receive, send) -> None:
    """Answers with how much of the body the first `receive` held, once uvicorn
    has read all it reads before the app asks: the whole body, or up to where
    it pauses reading."""
    cycle = receive.__self__  # uvicorn's RequestResponseCycle: the body it has read and its flow control
    await wait_until_async(lambda: not cycle.more_body or cycle.flow.read_paused, 10, "uvicorn done reading ahead",
                           observe=lambda: len(cycle.body))
    message = await receive()
    answer = f"{len(message['body'])} {message['more_body']}".encode()
    while message.get("more_body"):
        message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": answer})


async def first_piece_size(http: str) -> tuple[int, bool]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(first_piece, port=port, http=http, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    await wait_until_async(lambda: server.started, 10, "uvicorn serving")
    try:
        async with httpx.AsyncClient() as client:
            response = await client.post(f"http://127.0.0.1:{port}/", content=BODY, timeout=10)
    finally:
        server.should_exit = True
        await serving
    size, more = response.text.split()
    return int(size), more == "True"


@pytest.fixture
def restore_limits():
    saved = httptools_impl.HIGH_WATER_LIMIT, h11_impl.HIGH_WATER_LIMIT
    yield
    httptools_impl.HIGH_WATER_LIMIT, h11_impl.HIGH_WATER_LIMIT = saved


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_body_arrives_whole(http, restore_limits) -> None:
    httptools_impl.HIGH_WATER_LIMIT = h11_impl.HIGH_WATER_LIMIT = 65536  # uvicorn's own
    size, more = asyncio.run(first_piece_size(http))
    assert more and size < len(BODY), "uvicorn paused at 64 KB: the check below could not fail"
    buffer_whole_bodies(4 * 2**20)
    assert asyncio.run(first_piece_size(http)) == (len(BODY), False)


def test_the_buffer_is_capped(restore_limits) -> None:
    buffer_whole_bodies(2**30)
    assert httptools_impl.HIGH_WATER_LIMIT == h11_impl.HIGH_WATER_LIMIT == 16 * 2**20


def test_a_body_that_came_whole_is_not_copied() -> None:
    async def receive():
        return {"type": "http.request", "body": BODY, "more_body": False}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    assert asyncio.run(read_body(request, 4 * 2**20, 5)) is BODY


def test_parsing_is_counted_as_what_it_builds_and_a_body_of_tiny_parts_is_refused():
    from gateway.api.parsing import PARSED_BYTES_PER_CONTAINER, PARSED_BYTES_PER_VALUE, parsing_cost
    from gateway.errors import APIError

    image = b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,' + BODY + b'"}}]}]}'
    # a data URL's bytes: one str, already counted; the values beside it: three past each container's first
    assert parsing_cost(image, 100) == 6 * PARSED_BYTES_PER_CONTAINER + 3 * PARSED_BYTES_PER_VALUE
    numbers = b'{"stop_token_ids":[' + b",".join([b"7"] * 10**6) + b"]}"  # 2 MB that parse into tens of MB
    assert parsing_cost(numbers, 100) == 2 * PARSED_BYTES_PER_CONTAINER + (10**6 - 1) * PARSED_BYTES_PER_VALUE
    assert parsing_cost('{"content":"héllo"}'.encode(), 100) == PARSED_BYTES_PER_CONTAINER + 4 * len('{"content":"héllo"}'.encode())
    accented = image[:-4] + ',{"type":"text","text":"l’image"}]}]}'.encode()  # the data URL: one byte a character still
    assert parsing_cost(accented, 100) < 7 * PARSED_BYTES_PER_CONTAINER + 5 * PARSED_BYTES_PER_VALUE + 4 * 200
    with pytest.raises(APIError) as refused:
        parsing_cost(b"[" + b",".join([b"{}"] * 200) + b"]", 100)
    assert refused.value.status == 413 and "201 JSON objects and arrays" in refused.value.message
