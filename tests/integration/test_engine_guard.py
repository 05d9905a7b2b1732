"""A wrong embedding shape sent straight to the engine is refused for that
request alone: the engine (and vLLM's core) stays alive."""

from __future__ import annotations

import asyncio

import torch
import zmq.asyncio

from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_engine import ChatMessage, ChatPart, GenerateRequest, ImageEmbedding, SamplingOptions
from protocol.to_gateway import GatewayInbound, GenerateFailed, TokenDelta


async def _send_raw(address: str, request: GenerateRequest, frames) -> object:
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        await socket.send(request, frames)
        while True:
            message, _ = await asyncio.wait_for(socket.recv(), 60)
            if isinstance(message, GenerateFailed) or (isinstance(message, TokenDelta) and message.finish_reason):
                return message
    finally:
        socket.close()
        ctx.term()


def _request(rid: str, tensor: torch.Tensor, grid) -> tuple[GenerateRequest, list]:
    meta, frame = to_frame(tensor)
    message = ChatMessage("user", [ChatPart("image"), ChatPart("text", "hi")])
    return GenerateRequest(rid, [message], SamplingOptions(max_tokens=2, temperature=0), [ImageEmbedding(meta, grid)]), [frame]


def test_three_d_embeddings_are_refused_and_the_engine_lives(stack, client):
    bad = asyncio.run(_send_raw(stack.engine_addresses[0], *_request("guard-3d", torch.randn(1, 4, 128), (1, 4, 4))))
    assert isinstance(bad, GenerateFailed) and bad.status == 400 and "2-D" in bad.message
    wrong_rows = asyncio.run(_send_raw(stack.engine_addresses[0], *_request("guard-rows", torch.randn(9, 128), (1, 4, 4))))
    assert isinstance(wrong_rows, GenerateFailed) and "does not match grid" in wrong_rows.message
    good = asyncio.run(_send_raw(stack.engine_addresses[0], *_request("guard-ok", torch.randn(4, 128), (1, 4, 4))))
    assert isinstance(good, TokenDelta) and good.completion_tokens == 2
    assert client.chat.completions.create(model="prism-demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2).usage.completion_tokens == 2


def test_sampling_values_vllm_refuses_are_a_400_not_a_500(stack):
    message = ChatMessage("user", [ChatPart("text", "hi")])
    request = GenerateRequest("guard-stop", [message], SamplingOptions(max_tokens=2, stop=[""]))
    failed = asyncio.run(_send_raw(stack.engine_addresses[0], request, []))
    assert isinstance(failed, GenerateFailed) and failed.status == 400 and "sampling" in failed.message
