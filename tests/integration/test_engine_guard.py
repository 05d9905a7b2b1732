"""A wrong embedding shape sent straight to the engine is refused for that
request alone: the engine (and vLLM's core) stays alive."""

from __future__ import annotations

import asyncio

import torch

from protocol.to_engine import GenerateRequest
from protocol.to_gateway import GenerateFailed, TokenDelta
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
