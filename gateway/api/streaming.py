"""Responses with a write deadline: server-sent events, and a completion's body.

A client that stops reading its stream fills the socket buffers, and then
uvicorn's `send` waits for them to drain, for ever: the request would hold
its concurrency slot and its generation in vLLM for as long as the client
keeps the connection open. Here each chunk must be taken within
`write_timeout_s`. Past it, the body iterator is told (`ClientNotReading`
thrown in where it waits, so it ends its request: abort in vLLM, slot back),
and the response is left incomplete, which makes uvicorn close the
connection. A client that hangs up is heard between two chunks (Starlette's
disconnect listener cancels the stream), however many are queued.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send


class ClientNotReading(Exception):
    """The client took no chunk within the write deadline."""


class DeadlineStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], write_timeout_s: float) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        try:
            await self._send_chunks(send)
        finally:  # cancelled between chunks (a hang-up): the iterator's own cleanup (abort, slot back) runs now,
            with anyio.CancelScope(shield=True):  # not whenever the collector gets to it
                await self.body_iterator.aclose()

    async def _send_chunks(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except TimeoutError:
                with contextlib.suppress(StopAsyncIteration, ClientNotReading):
                    await self.body_iterator.athrow(
                        ClientNotReading(f"no chunk taken within {self.write_timeout_s:g} s (gateway.stream_write_timeout_s)")
                    )
                return  # incomplete: uvicorn closes the connection
            # A turn of the loop for everything else between chunks: neither a reply already queued nor a
            # send into a socket with room waits, so a backlog of thousands of chunks ran in one go,
            # holding every other request, and a client that hung up was heard only at its end.
            await asyncio.sleep(0)
        with contextlib.suppress(TimeoutError):  # a client that stopped reading at the end: left incomplete
            async with asyncio.timeout(self.write_timeout_s):
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class DeadlineJSONResponse(JSONResponse):
    """A completion's body, sent in pieces each of which the client must take within
    `write_timeout_s`, or the rest is not sent and uvicorn closes the connection. Sent whole,
    uvicorn took all of it into its write buffer at once, where a client that does not read
    held it for as long as it kept the connection. `on_sent` runs once it was taken or given up
    (the request's ticket: its slot, and its memory, the body's bytes counted in it until then)."""

    def __init__(self, content, write_timeout_s: float, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers=headers)
        self.write_timeout_s = write_timeout_s
        self.on_sent: Callable[[], None] = lambda: None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            last = max(0, len(self.body) - 1) // BODY_PIECE_BYTES * BODY_PIECE_BYTES
            for start in range(0, last + 1, BODY_PIECE_BYTES):
                async with asyncio.timeout(self.write_timeout_s):  # uvicorn waits for its buffer to drain first
                    await send({"type": "http.response.body", "body": self.body[start:start + BODY_PIECE_BYTES],
                                "more_body": start < last})
        except TimeoutError:
            pass  # incomplete: uvicorn closes the connection
        finally:
            self.on_sent()


BODY_PIECE_BYTES = 2**20  # what a completion's body holds in uvicorn's buffer at most
