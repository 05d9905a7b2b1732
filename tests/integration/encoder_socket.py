"""Talking to one encoder directly over its ZMQ socket, as the gateway does."""

from __future__ import annotations

import asyncio

import torch
import zmq.asyncio

from protocol.base import Hello
from protocol.sockets import AsyncDealer
from protocol.tensors import to_torch
from protocol.to_encoder import FetchEmbeddings
from protocol.to_engine import FetchInbound
from protocol.to_gateway import EncodedImage, EncoderReady


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


async def fetch_tokens(ctx: zmq.asyncio.Context, address: str, images: list[EncodedImage]) -> list[torch.Tensor | None]:
    """The images' tokens, fetched from the encoder by reference as an engine does (None: not held)."""
    socket = AsyncDealer(ctx, address, FetchInbound)
    try:
        await socket.send(FetchEmbeddings("test-fetch", [i.key for i in images], [i.identity for i in images]))
        reply, frames = await asyncio.wait_for(socket.recv(), 30)
        tensors = iter(frames)
        return [None if meta is None else to_torch(meta, next(tensors)).clone() for meta in reply.found]
    finally:
        socket.close()
