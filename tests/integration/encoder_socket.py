"""Talking to one encoder directly over its ZMQ socket, as the gateway does."""

from __future__ import annotations

import asyncio

from protocol.base import Hello
from protocol.sockets import AsyncDealer
from protocol.to_gateway import EncoderReady


async def handshake(socket: AsyncDealer, timeout_s: float = 120) -> EncoderReady:
    """Hello until the encoder answers (it may still be loading)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        await socket.send(Hello("test"))
        try:
            message, _ = await asyncio.wait_for(socket.recv(), 2)
            if isinstance(message, EncoderReady):
                return message
        except asyncio.TimeoutError:
            pass
    raise TimeoutError(f"no encoder answered within {timeout_s} s")


async def reply_to(socket: AsyncDealer, request_id: str, timeout_s: float = 60):
    """The reply for one request (answers to earlier handshakes are skipped)."""
    while True:
        message, frames = await asyncio.wait_for(socket.recv(), timeout_s)
        if getattr(message, "request_id", None) == request_id:
            return message, frames
