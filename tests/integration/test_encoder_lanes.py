"""A small image is never held behind a large one's ViT time: while the main
lane encodes a megapixel image, a 256² image sent after it goes through the
encoder's express lane and is answered first (vision_encoder/service.py).
Talks to a standalone encoder over its socket, as the gateway does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq.asyncio

from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL
from prism.synthetic import make_image
from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.to_gateway import EncodeResult, GatewayInbound
from tests.integration.encoder_socket import handshake

LARGE, SMALL = (1288, 812), (252, 252)  # at the 1 MP budget: 5,336 and 324 patches


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lanes")
    address = f"ipc://{run_dir}/encoder.sock"
    env = dict(os.environ, PRISM_MODEL=str(RANDOM_MODEL), PRISM_ENCODER__ADDRESS=address,
               PRISM_ENCODER__MAX_PIXELS=str(1024 * 1024), PRISM_ENCODER__DTYPE="float32")
    process = subprocess.Popen([sys.executable, "-m", "vision_encoder"], cwd=REPO_ROOT, env=env,
                               stdout=open(run_dir / "encoder.log", "wb"), stderr=subprocess.STDOUT)
    yield address
    process.terminate()
    process.wait(10)


def image_input(name: str, size: tuple[int, int]) -> tuple[ImageInput, memoryview]:
    meta, frame = to_frame(np.asarray(make_image(name, size).convert("RGB")))
    return ImageInput(os.urandom(16), meta), frame


async def answer_order(address: str) -> tuple[list[str], dict[str, float]]:
    """Send a large image, then a small one; the order their answers come in, and when."""
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        await handshake(socket)
        started = time.monotonic()
        for request_id, size in (("large", LARGE), ("small", SMALL)):
            image, frame = image_input(f"lanes-{request_id}", size)
            await socket.send(EncodeRequest(request_id, [image]), [frame])
            await asyncio.sleep(0.05)  # the large batch is running when the small image arrives
        order, at = [], {}
        while len(order) < 2:
            message, _ = await asyncio.wait_for(socket.recv(), 120)
            if isinstance(message, EncodeResult):
                order.append(message.request_id)
                at[message.request_id] = time.monotonic() - started
        return order, at
    finally:
        socket.close()
        ctx.term()


def test_a_small_image_sent_after_a_large_one_is_answered_first(encoder):
    order, at = asyncio.run(answer_order(encoder))
    assert order == ["small", "large"], at
