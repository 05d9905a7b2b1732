"""A language model without a vision part is served text-only: no encoder
runs, text requests are answered, and a request with an image gets a 400
naming the model before any image is fetched. Configured with encoders
anyway, `prism serve` stops at once and says why."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from gateway.config import GatewayConfig
from prism.launch import service_children
from testing.stack import LocalStack
from prism.tiny_models import ensure_tiny_model
from protocol.to_gateway import GenerateFailed
from tests.integration.conftest import ONE_PROCESS_ENGINE, STACK_OVERRIDES
from tests.integration.helpers import embeddings_request, send_raw

ENGINE_ONLY = {k: v for k, v in STACK_OVERRIDES.items() if not k.startswith("PRISM_ENCODER__")} | ONE_PROCESS_ENGINE


@pytest.fixture(scope="module")
def text_stack(tmp_path_factory):
    checkpoint = ensure_tiny_model("qwen2-text")
    with LocalStack(tmp_path_factory.mktemp("text-only"), ENGINE_ONLY, model=checkpoint, encoder_replicas=0) as stack:
        yield stack, OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_is_answered_with_no_encoder_running(text_stack):
    stack, client = text_stack
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
    ready = httpx.get(f"{stack.base_url}/health/ready").json()
    assert ready["status"] == "ready" and [m["encoder"] for m in ready["models"].values()] == ["none"]


def test_an_image_gets_a_400_naming_the_model(text_stack):
    stack, client = text_stack
    name = client.models.list().data[0].id
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}  # never fetched
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}],
                                       max_tokens=5)
    error = caught.value.body
    assert error["code"] == "images_not_supported" and error["param"] == "messages[0].content[0]"
    assert f"model '{name}' is served text-only" in error["message"]


def test_the_engine_refuses_embeddings_sent_to_it_directly(text_stack):
    stack, _ = text_stack
    reply = asyncio.run(send_raw(stack.engine_addresses[0], *embeddings_request("no-images", torch.randn(4, 128), None)))
    assert isinstance(reply, GenerateFailed) and reply.status == 400 and "text-only" in reply.message


def test_prism_serve_refuses_encoders_for_a_text_only_model():
    checkpoint = str(ensure_tiny_model("qwen2-text"))
    config = GatewayConfig(models={"chat": {"encoder_addresses": ["ipc:///tmp/x.sock"], "engine_addresses": ["ipc:///tmp/y.sock"],
                                            "checkpoint": checkpoint}})
    with pytest.raises(SystemExit, match="text-only: list no encoder addresses"):
        service_children(config, None, checkpoint)
