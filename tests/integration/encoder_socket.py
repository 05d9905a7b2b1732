"""Talking to one encoder directly over its ZMQ socket, as the gateway does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zmq
import zmq.asyncio

from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from protocol.base import PROTOCOL, Hello
from protocol.sockets import AsyncDealer
from loadtest.synthetic import make_image
from protocol.tensors import to_frame, to_torch
from protocol.to_encoder import EncodeRequest, FetchEmbeddings, ImageInput
from protocol.to_engine import FetchInbound
from protocol.stats import EncoderStats, StatsRequest
from protocol.to_gateway import EncodedImage, EncodeResult, EncoderReady, GatewayInbound
from vision_encoder.config import EncoderConfig
from vision_encoder.service import EncoderService


@dataclass(frozen=True)
class EncoderProcess:
    address: str  # ipc://<run_dir>/<name>.sock, bound once it has loaded
    process: subprocess.Popen
    log: Path


@contextlib.contextmanager
def encoder_process(run_dir: Path, model: Path = RANDOM_MODEL, name: str = "encoder", **settings: str) -> Iterator[EncoderProcess]:
    """`python -m vision_encoder` on `model` with `settings` (PRISM_ENCODER__* variables), bound
    at run_dir/<name>.sock, its output in run_dir/<name>.log; stopped afterwards (SIGTERM, then
    SIGKILL), unless the test stopped it itself."""
    address = f"ipc://{run_dir}/{name}.sock"
    if model == RANDOM_MODEL:
        ensure_demo_model(RANDOM_MODEL)  # a test file run alone may be the first to need it
    env = dict(os.environ, PRISM_MODEL=str(model), PRISM_ENCODER__ADDRESS=address, **settings)
    log = run_dir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "vision_encoder"], cwd=REPO_ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        yield EncoderProcess(address, process, log)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def encoder_in_thread(run_dir: Path, **settings) -> tuple[str, EncoderService]:
    """An encoder service on the random demo model (float32, EncoderConfig `settings`) in this
    process, serving on a daemon thread for the rest of the session: its address, and the service
    (its tower at hand, to wrap before the first request)."""
    address = f"ipc://{run_dir}/encoder.sock"
    config = EncoderConfig(model=str(ensure_demo_model(RANDOM_MODEL)), address=address, dtype="float32", **settings)
    service = EncoderService.start(config, zmq.Context.instance())
    threading.Thread(target=service.run_forever, daemon=True).start()
    return address, service


def start_encoder(run_dir: Path, **settings: str):
    """A standalone encoder on the random demo model (float32, 1 MP budget); a
    fixture's generator: yields its address, stops it afterwards."""
    with encoder_process(run_dir, PRISM_ENCODER__MAX_PIXELS=str(1024 * 1024), PRISM_ENCODER__DTYPE="float32",
                         **settings) as encoder:
        yield encoder.address


async def stats_of(socket: AsyncDealer) -> EncoderStats:
    await socket.send(StatsRequest("test"))
    while not isinstance(message := (await asyncio.wait_for(socket.recv(), 10))[0], EncoderStats):
        pass
    return message


def encoder_stats(address: str) -> EncoderStats:
    """One encoder's stats, asked of it: current (an encoder counts an encode
    before it answers), where the gateway's scrape lags a stats poll behind."""
    async def ask() -> EncoderStats:
        ctx = zmq.asyncio.Context()
        socket = AsyncDealer(ctx, address, GatewayInbound)
        try:
            return await stats_of(socket)
        finally:
            socket.close()
            ctx.term()
    return asyncio.run(ask())


async def handshake(socket: AsyncDealer, timeout_s: float = 120) -> EncoderReady:
    """Hello until the encoder answers (it may still be loading)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        await socket.send(Hello("test", PROTOCOL))
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


async def replies_to(socket: AsyncDealer, request_ids: list[str], timeout_s: float = 60) -> dict:
    """The replies for these requests, in whichever order they come (others' are skipped)."""
    replies: dict = {}
    while len(replies) < len(request_ids):
        message, _ = await asyncio.wait_for(socket.recv(), timeout_s)
        if (request_id := getattr(message, "request_id", None)) in request_ids:
            replies[request_id] = message
    return replies


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


async def encode_directly(address: str, names: list[str], size: tuple[int, int] = (112, 112)) -> EncodeResult:
    """Encode synthetic images on one encoder as the gateway would (pixels sent at once)."""
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        await handshake(socket)
        inputs, frames = [], []
        for name in names:
            meta, frame = to_frame(np.asarray(make_image(name, size).convert("RGB")))
            inputs.append(ImageInput(os.urandom(16), meta))
            frames.append(frame)
        await socket.send(EncodeRequest("direct", inputs), frames)
        reply, _ = await reply_to(socket, "direct")
        assert isinstance(reply, EncodeResult), reply
        return reply
    finally:
        socket.close()
        ctx.term()
