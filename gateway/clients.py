"""The gateway's side of the encoder and engine sockets.

Each client owns one DEALER socket and one receive task. The receive task is
the only reader: it routes every reply by request id to that request's queue,
so each request's state has exactly one owner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq.asyncio

from gateway.errors import APIError
from protocol.base import Hello
from protocol.sockets import AsyncDealer
from protocol.to_encoder import CancelEncode, EncodeRequest, ImageInput
from protocol.to_engine import AbortGenerate, GenerateRequest
from protocol.stats import EncoderStats, EngineStats, StatsRequest
from protocol.to_gateway import (
    EncodeFailed,
    EncoderReady,
    EncodeResult,
    EngineReady,
    GatewayInbound,
    GenerateFailed,
    TokenDelta,
)

log = logging.getLogger("prism.gateway")


class ServiceClient:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, name: str) -> None:
        self.name = name
        self.address = address
        self.socket = AsyncDealer(ctx, address, GatewayInbound)
        self._streams: dict[str, asyncio.Queue] = {}
        self._ready: asyncio.Future | None = None
        self._receiver: asyncio.Task | None = None
        self._poller: asyncio.Task | None = None
        self.info: Any = None
        self.stats: Any = None  # latest EncoderStats / EngineStats
        self.stats_received_at: float | None = None  # loop time; the heartbeat

    async def connect(self, timeout_s: float) -> Any:
        """Handshake: Hello until the service answers (it may still be loading)."""
        self._receiver = asyncio.create_task(self._receive_loop())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._ready = loop.create_future()
            await self.socket.send(Hello("gateway"))
            try:
                self.info = await asyncio.wait_for(asyncio.shield(self._ready), timeout=2.0)
                return self.info
            except asyncio.TimeoutError:
                if loop.time() > deadline:
                    raise RuntimeError(f"{self.name} at {self.address} did not answer within {timeout_s:.0f} s") from None

    async def _receive_loop(self) -> None:
        while True:
            message, frames = await self.socket.recv()
            if isinstance(message, (EncoderReady, EngineReady)):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(message)
                continue
            if isinstance(message, (EncoderStats, EngineStats)):
                self.stats = message
                self.stats_received_at = asyncio.get_running_loop().time()
                continue
            queue = self._streams.get(message.request_id)
            if queue is None:
                continue  # the request was already given up (timeout, disconnect)
            queue.put_nowait((message, frames))

    def start_polling(self, interval_s: float, on_stats=None) -> None:
        """Ask for stats every interval (a heartbeat as well as numbers)."""

        async def poll() -> None:
            while True:
                await self.socket.send(StatsRequest("gateway"))
                await asyncio.sleep(interval_s)
                if on_stats is not None and self.stats is not None:
                    on_stats(self.stats)

        self._poller = asyncio.create_task(poll())

    def open(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def close(self) -> None:
        for task in (self._receiver, self._poller):
            if task:
                task.cancel()
        self.socket.close()


class EncoderClient(ServiceClient):
    async def encode(
        self, request_id: str, images: Sequence[ImageInput], frames: Sequence[Any], timeout_s: float
    ) -> tuple[EncodeResult, list[memoryview]]:
        queue = self.open(request_id)
        try:
            await self.socket.send(EncodeRequest(request_id, list(images)), frames)
            message, reply_frames = await asyncio.wait_for(queue.get(), timeout_s)
        except asyncio.TimeoutError:
            await self.socket.send(CancelEncode(request_id))
            raise APIError(504, f"vision encoder did not answer within {timeout_s:.0f} s", code="encoder_timeout") from None
        except asyncio.CancelledError:
            await self.socket.send(CancelEncode(request_id))
            raise
        finally:
            self.close_stream(request_id)
        if isinstance(message, EncodeFailed):
            raise APIError(500, f"vision encoder failed: {message.message}", code="encoder_error")
        return message, reply_frames


class EngineClient(ServiceClient):
    async def generate(
        self, request: GenerateRequest, frames: Sequence[Any], timeout_s: float
    ) -> AsyncIterator[TokenDelta]:
        """Token deltas until the finishing one; aborts in vLLM if abandoned."""
        queue = self.open(request.request_id)
        finished = False
        try:
            await self.socket.send(request, frames)
            while not finished:
                message, _ = await asyncio.wait_for(queue.get(), timeout_s)
                if isinstance(message, GenerateFailed):
                    finished = True
                    raise APIError(message.status, message.message, code="engine_error" if message.status >= 500 else None)
                finished = message.finish_reason is not None
                yield message
        except asyncio.TimeoutError:
            raise APIError(504, f"engine produced no token within {timeout_s:.0f} s", code="engine_timeout") from None
        finally:
            self.close_stream(request.request_id)
            if not finished:
                await self.socket.send(AbortGenerate(request.request_id))
