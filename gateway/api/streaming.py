"""Server-sent events with a write deadline.

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

from starlette.responses import StreamingResponse
from starlette.types import Send


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
