"""A forced hash collision never serves the wrong tokens.

An encoder alone, with its test hook truncating cache keys to one byte: 96
different images collide (48 would have no two alike for about one fingerprint
in 80). Every later lookup either returns that image's own embeddings or asks
for its pixels again; never another image's tokens.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import zmq.asyncio

from prism.demo_model import SHAPES_MODEL
from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.to_gateway import EncodeNeedsPixels, EncodeResult, GatewayInbound
from tests.integration.encoder_socket import encoder_process, fetch_tokens, handshake, reply_to

IMAGES = 96


@pytest.fixture(scope="module")
def encoder_address(tmp_path_factory):
    with encoder_process(tmp_path_factory.mktemp("collisions"), SHAPES_MODEL, PRISM_ENCODER__TEST_KEY_BYTES="1",
                         PRISM_ENCODER__DTYPE="float32") as encoder:
        yield encoder.address


async def exchange(address: str) -> tuple[dict, dict, int]:
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        await handshake(socket)
        rng = np.random.default_rng(0)
        pixels = [rng.integers(0, 255, (56, 56, 3), dtype=np.uint8) for _ in range(IMAGES)]
        digests = [i.to_bytes(16, "big") for i in range(IMAGES)]
        first, again, asked = {}, {}, 0
        for i in range(IMAGES):  # encode each image once
            meta, frame = to_frame(pixels[i])
            await socket.send(EncodeRequest(f"first-{i}", [ImageInput(digests[i], meta)]), [frame])
            reply, _ = await reply_to(socket, f"first-{i}")
            assert isinstance(reply, EncodeResult)
            (first[i],) = await fetch_tokens(ctx, address, reply.images)
        for i in range(IMAGES):  # then look each up by digest alone
            await socket.send(EncodeRequest(f"again-{i}", [ImageInput(digests[i])]))
            reply, _ = await reply_to(socket, f"again-{i}")
            if isinstance(reply, EncodeNeedsPixels):
                asked += 1
            else:
                (again[i],) = await fetch_tokens(ctx, address, reply.images)
        return first, again, asked
    finally:
        socket.close()
        ctx.term()


def test_truncated_keys_collide_and_identity_keeps_tokens_right(encoder_address):
    first, again, asked = asyncio.run(exchange(encoder_address))
    assert asked > 0  # one-byte keys: collisions happened and were refused as hits
    assert again  # and the entries that survived are still served
    for i, embeddings in again.items():
        assert torch.equal(embeddings, first[i]), f"image {i} got another image's tokens"
