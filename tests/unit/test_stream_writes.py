"""A stream's writes to a client that stops reading end at gateway.stream_write_timeout_s,
the last one (the body's end) included (gateway/api/streaming.py)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.api.streaming import DeadlineJSONResponse, DeadlineStreamingResponse


def test_a_client_that_stops_reading_at_the_stream_s_end_does_not_hold_it_open():
    sent: list[dict] = []

    async def chunks():
        yield b"data: 1\n\n"

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message["more_body"]:
            await asyncio.Event().wait()  # its socket's buffer full: the last write never drains

    response = DeadlineStreamingResponse(chunks(), 0.05)
    asyncio.run(asyncio.wait_for(response.stream_response(send), 5))
    assert [m.get("more_body") for m in sent] == [None, True, False]


def test_a_client_that_hangs_up_is_heard_between_chunks_of_a_backlog():
    """Replies already queued and a socket with room never wait: without a turn of the loop
    between chunks, a backlog ran to its end (every other request held meanwhile) before the
    hang-up was heard, and the request was logged as a 200."""
    total, made, hung_up, ended = 10_000, [0], asyncio.Event(), []

    async def backlog():
        try:
            for _ in range(total):
                made[0] += 1
                yield b"data: {}\n\n"
        finally:  # the request's end (its abort in vLLM, its slot back), as the chat handler's stream has it
            ended.append(True)

    async def send(message: dict) -> None:  # as uvicorn's: returns at once, and quietly once the client is gone
        if message["type"] == "http.response.body" and made[0] == 100:
            hung_up.set()

    async def receive() -> dict:
        await hung_up.wait()
        return {"type": "http.disconnect"}

    async def respond() -> list[bool]:
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}  # uvicorn's: Starlette listens for the disconnect
        await asyncio.wait_for(DeadlineStreamingResponse(backlog(), 5)(scope, receive, send), 10)
        return list(ended)  # before the loop's own shutdown closes what is left

    assert asyncio.run(respond()), "the stream's cleanup waited for the garbage collector"
    assert made[0] < 200, f"{made[0]} of {total} chunks made for a client that hung up at the 100th"


@pytest.mark.parametrize("reads", [True, False])
def test_a_completion_s_body_is_given_up_past_the_deadline_and_its_ticket_released_once(reads):
    """A client that does not read a completion held its body in uvicorn's buffer for as long as it kept
    the connection, uncounted, its slot given back before a byte was sent."""
    sent: list[dict] = []
    released: list[bool] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not reads:
            await asyncio.Event().wait()  # its socket's buffer full: the body never drains

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    response = DeadlineJSONResponse({"choices": []}, 0.05)
    response.on_sent = lambda: released.append(True)
    asyncio.run(asyncio.wait_for(response({"type": "http"}, receive, send), 5))
    assert released == [True] and [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_a_completion_a_client_does_not_read_is_not_handed_whole_to_uvicorn():
    """Under real uvicorn: sent whole, the body went into uvicorn's write buffer at once (the deadline
    and the ticket's release passed before a byte left) and stayed there, all of it, for as long as
    the client kept the connection. In pieces, the deadline stops it with a few MiB handed over."""
    import socket
    import threading

    import uvicorn

    from testing.stack import free_port

    size, handed, given_up = 48 * 2**20, [0], threading.Event()

    async def app(scope, receive, send):
        async def counted(message: dict) -> None:
            handed[0] += len(message.get("body", b""))
            await send(message)

        if scope["type"] == "http":
            response = DeadlineJSONResponse({"text": "x" * size}, 1.0)
            response.on_sent = given_up.set
            await response(scope, receive, counted)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            threading.Event().wait(0.05)
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
            assert given_up.wait(30)
        assert handed[0] < size // 3, f"{handed[0]} bytes of a {size}-byte body handed to uvicorn for a client that did not read"
    finally:
        server.should_exit = True
        thread.join(10)
