"""A wrong embedding shape sent straight to the engine is refused for that
request alone: the engine (and vLLM's core) stays alive."""

from __future__ import annotations

import asyncio
import collections

import torch
import zmq.asyncio

from protocol.sockets import AsyncDealer
from protocol.to_engine import GenerateRequest
from protocol.to_gateway import GatewayInbound, GenerateFailed, TokenDelta
from tests.integration.helpers import chat_json, embeddings_request, send_raw


def test_three_d_embeddings_are_refused_and_the_engine_lives(stack, client):
    bad = asyncio.run(send_raw(stack.engine_addresses[0], *embeddings_request("guard-3d", torch.randn(1, 4, 128), (1, 4, 4))))
    assert isinstance(bad, GenerateFailed) and bad.status == 400 and "2-D" in bad.message
    wrong_rows = asyncio.run(send_raw(stack.engine_addresses[0], *embeddings_request("guard-rows", torch.randn(9, 128), (1, 4, 4))))
    assert isinstance(wrong_rows, GenerateFailed) and "does not match grid" in wrong_rows.message
    good = asyncio.run(send_raw(stack.engine_addresses[0], *embeddings_request("guard-ok", torch.randn(4, 128), (1, 4, 4))))
    assert isinstance(good, TokenDelta) and good.completion_tokens == 2
    assert client.chat.completions.create(model="prism-demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2).usage.completion_tokens == 2


def test_sampling_values_vllm_refuses_are_a_400_not_a_500(stack):
    request = GenerateRequest("guard-stop", chat_json([{"role": "user", "content": "hi"}], max_tokens=2, stop=[""]))
    failed = asyncio.run(send_raw(stack.engine_addresses[0], request))
    assert isinstance(failed, GenerateFailed) and failed.status == 400 and "sampling" in failed.message


BURST = 320  # past the session engine's max_waiting_requests (256, configs/cpu-demo.yaml)


async def burst_outcomes(address: str) -> collections.Counter:
    """Every request of a burst sent back to back on one socket, as a busy
    gateway's would queue on the engine's: each one's final status."""
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        chat = chat_json([{"role": "user", "content": "hi"}], max_tokens=1, temperature=0)
        for index in range(BURST):
            await socket.send(GenerateRequest(f"burst-{index}", chat))
        outcomes: dict[str, object] = {}
        while len(outcomes) < BURST:
            message, _ = await asyncio.wait_for(socket.recv(), 120)
            if isinstance(message, GenerateFailed) or (isinstance(message, TokenDelta) and message.finished):
                outcomes[message.request_id] = message.status if isinstance(message, GenerateFailed) else "ok"
        return collections.Counter(outcomes.values())
    finally:
        socket.close()
        ctx.term()


def test_a_burst_past_the_waiting_limit_is_refused_429_beyond_it(stack):
    """The engine reads a queued burst without a turn of its event loop: each
    request counts as waiting from the moment it is read, or none would be refused."""
    outcomes = asyncio.run(burst_outcomes(stack.engine_addresses[0]))
    assert set(outcomes) == {"ok", 429} and outcomes["ok"] >= 256, outcomes
