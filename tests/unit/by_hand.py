"""An encoder or an engine on a real ROUTER socket, answered by the test:
for unit tests of the gateway's pools and pipeline over real sockets."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from protocol.base import Hello, Message
from protocol.sockets import AsyncRouter
from protocol.stats import EngineStats, StatsRequest
from protocol.to_encoder import EncoderInbound
from protocol.to_engine import EngineInbound
from protocol.to_gateway import EncoderReady, EngineReady, ProcessorInfo


class ByHand:
    """Answers the handshake (`ready`) and stats itself; every other message
    goes to `answer`, whose reply, if any, is sent back."""

    inbound: object

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.router = AsyncRouter(ctx, address, self.inbound)
        self.task = asyncio.create_task(self._serve())

    def ready(self) -> Message:
        raise NotImplementedError

    def stats(self) -> Message | None:
        return None

    def answer(self, message: Message) -> Message | None:
        return None

    async def _serve(self) -> None:
        while True:
            peer, message, _ = await self.router.recv()
            await self.respond(peer, message)

    async def respond(self, peer: bytes, message: Message) -> None:
        if isinstance(message, Hello):
            reply = self.ready()
        elif isinstance(message, StatsRequest):
            reply = self.stats()
        else:
            reply = self.answer(message)
        if reply is not None:
            await self.router.send(peer, reply)

    def stop(self) -> None:
        self.task.cancel()
        self.router.close()


class EncoderByHand(ByHand):
    inbound = EncoderInbound

    def ready(self) -> Message:
        return EncoderReady("m", "fingerprint", ProcessorInfo(14, 2, 56 * 56, 140 * 140, "Qwen2VLVideoProcessor"))


class EngineByHand(ByHand):
    inbound = EngineInbound
    takes_pushes = True
    scheduling_policy = "fcfs"

    def ready(self) -> Message:
        return EngineReady("m", 4096, takes_pushes=self.takes_pushes, scheduling_policy=self.scheduling_policy)

    def stats(self) -> Message:
        return EngineStats("boot", 0, 0, 0, 0)
