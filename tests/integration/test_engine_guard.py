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


async def burst_outcomes(address: str, requests: list[GenerateRequest]) -> dict[str, object]:
    """Every request of a burst sent back to back on one socket, as a busy
    gateway's would queue on the engine's: each one's outcome, "ok" or (status, code)."""
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        for request in requests:
            await socket.send(request)
        outcomes: dict[str, object] = {}
        while len(outcomes) < len(requests):
            message, _ = await asyncio.wait_for(socket.recv(), 120)
            if isinstance(message, GenerateFailed):
                outcomes[message.request_id] = (message.status, message.code)
            elif isinstance(message, TokenDelta) and message.finished:
                outcomes[message.request_id] = "ok"
        return outcomes
    finally:
        socket.close()
        ctx.term()


def burst(prefix: str, count: int, priority: int = 0) -> list[GenerateRequest]:
    """One-token requests for the engine's socket."""
    extra = {"priority": priority} if priority else {}
    chat = chat_json([{"role": "user", "content": "hi"}], max_tokens=1, temperature=0, **extra)
    return [GenerateRequest(f"{prefix}-{index}", chat, priority=priority) for index in range(count)]


def test_a_burst_past_the_waiting_limit_is_refused_429_beyond_it(stack):
    """The engine reads a queued burst without a turn of its event loop: each
    request counts as waiting from the moment it is read, or none would be refused."""
    outcomes = collections.Counter(asyncio.run(burst_outcomes(stack.engine_addresses[0], burst("burst", BURST))).values())
    assert set(outcomes) == {"ok", (429, None)} and outcomes["ok"] >= 256, outcomes
