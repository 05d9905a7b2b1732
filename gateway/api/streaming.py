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
from collections.abc import AsyncIterator

from collections.abc import Callable

from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send


class ClientNotReading(Exception):
    """The client took no chunk within the write deadline."""


class DeadlineStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], write_timeout_s: float) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
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
    """A completion's body, which a client that does not read would otherwise hold in the
    gateway's memory (uvicorn's write buffer) for as long as it keeps the connection: the body
    must be taken within `write_timeout_s`, or it is left incomplete and uvicorn closes the
    connection. `on_sent` runs once it was taken or given up (the request's ticket: its slot,
    and its memory, the body's bytes counted in it until then)."""

    def __init__(self, content, write_timeout_s: float, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers=headers)
        self.write_timeout_s = write_timeout_s
        self.on_sent: Callable[[], None] = lambda: None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await super().__call__(scope, receive, send)
        except TimeoutError:
            pass  # incomplete: uvicorn closes the connection
        finally:
            self.on_sent()
