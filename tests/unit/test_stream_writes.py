"""A stream's writes to a client that stops reading end at gateway.stream_write_timeout_s,
the last one (the body's end) included (gateway/api/streaming.py)."""

from __future__ import annotations

import asyncio

from gateway.api.streaming import DeadlineStreamingResponse


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
