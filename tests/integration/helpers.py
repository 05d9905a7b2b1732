"""Small helpers shared by the integration tests."""

from __future__ import annotations

import asyncio
import json

import msgspec
import psutil
import torch
import zmq.asyncio
from openai import OpenAI

from bench.faults import engine_core as engine_core_of
from testing.stack import scrape as scrape_metrics
from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_engine import IMAGE_PLACEHOLDER, GenerateRequest, ImageEmbedding, PushedEmbedding
from protocol.to_gateway import GatewayInbound, GenerateFailed, TokenDelta
from tests.integration.cases import CASES
from tests.integration.conftest import MODEL_NAME
from tests.waiting import wait_until  # noqa: F401 - the integration tests take it from here


def ask(client: OpenAI, case_name: str, images, **overrides):
    """Greedy completion of a shared case through Prism (non-streaming)."""
    case = CASES[case_name]
    kwargs = dict(model=MODEL_NAME, messages=case.openai_messages(images), max_tokens=case.max_tokens, temperature=0)
    kwargs.update(overrides)
    return client.chat.completions.create(**kwargs)


def stages(response) -> dict:
    return response.model_extra["prism"]["stages_ms"]


def log_records(stack, service: str | None = None, request_prefix: str = "") -> list[dict]:
    """The stack's JSON log lines, optionally of one service and one request id prefix."""
    lines = (stack.run_dir / "stack.log").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [
        r for r in records
        if (service is None or r.get("service") == service) and str(r.get("request_id", "")).startswith(request_prefix)
    ]


def child_pid(stack, module: str, address: str | None = None) -> int:
    """A process the stack's launcher started (LocalStack.child_pid)."""
    return stack.child_pid(module, address)


def service_pid(stack, module: str, address: str | None = None) -> int | None:
    """`child_pid`, or None between the old process's exit and the launcher's restart."""
    try:
        return child_pid(stack, module, address)
    except (LookupError, psutil.Error):
        return None


def engine_pid(stack, address: str | None = None) -> int | None:
    """An engine service's pid (by the address it binds when several run); None
    between the old process's exit and the launcher's restart."""
    return service_pid(stack, "llm_engine", address)


def engine_core(stack, address: str | None = None) -> psutil.Process:
    """vLLM's EngineCore process under one of the stack's engine services."""
    core = engine_core_of(psutil.Process(child_pid(stack, "llm_engine", address)))
    if core is None:
        raise LookupError("no EngineCore process")
    return core


def scrape(stack) -> dict[tuple[str, tuple], float]:
    """Every sample of the gateway's /metrics, by (name, sorted labels); `stack`: a stack or a gateway's URL."""
    return scrape_metrics(getattr(stack, "base_url", stack))


def metric_total(stack, name: str) -> float:
    """A metric of the gateway's summed over its label sets."""
    return sum(value for (sample, _), value in scrape(stack).items() if sample == name)


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie waiting to be reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sse_error(lines: list[str]) -> dict | None:
    """The error event of a stream that ended with one (OpenAI's shape), else None."""
    for line in lines:
        if line.startswith("data: {") and '"error"' in line:
            return json.loads(line.removeprefix("data: "))["error"]
    return None


async def final_reply(socket: AsyncDealer) -> object:
    """An engine's last word on a request sent on `socket`: its failure or its finishing delta."""
    while True:
        message, _ = await asyncio.wait_for(socket.recv(), 60)
        if isinstance(message, GenerateFailed) or (isinstance(message, TokenDelta) and message.finished):
            return message


Push = tuple[PushedEmbedding, memoryview]


async def send_raw(address: str, request: GenerateRequest, pushes: list[Push] = ()) -> object:
    """Straight to an engine's socket, as a gateway would: its failure or its
    finishing delta. `pushes` go first, on the same socket, as an encoder's
    would: the engine keeps each in its LRU before it reads the request."""
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        for push, frame in pushes:
            await socket.send(push, [frame])
        await socket.send(request)
        return await final_reply(socket)
    finally:
        socket.close()
        ctx.term()


def embeddings_request(rid: str, tensor: torch.Tensor, grid) -> tuple[GenerateRequest, list[Push]]:
    """A one-image request for `send_raw` whose tokens, any tensor at all, are
    pushed to the engine first: the reference names an encoder that is not
    there, so only the push can bring them (and a tensor the request's shape
    checks refuse is never looked for)."""
    meta, frame = to_frame(tensor)
    key, identity = rid.encode(), b"test-" + rid.encode()
    chat = chat_json([{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "hi"}]}], max_tokens=2, temperature=0)
    image = ImageEmbedding(meta, grid, key, "ipc:///nowhere", identity, pushed=True)
    return GenerateRequest(rid, chat, [image]), [(PushedEmbedding(key, identity, meta, grid), frame)]


def by_reference(source: str, image, request_id: str) -> GenerateRequest:
    """A one-image request whose tokens (an EncodedImage) the engine fetches from `source`."""
    chat = chat_json([{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "hi"}]}], max_tokens=2, temperature=0)
    return GenerateRequest(request_id, chat, [ImageEmbedding(image.embeddings, image.grid_thw, image.key, source, image.identity)])


IMAGE_PART = {"type": "image_url", "image_url": {"url": IMAGE_PLACEHOLDER}}


def chat_json(messages: list[dict], **fields) -> bytes:
    """A GenerateRequest's `chat`: the OpenAI request as the gateway forwards it."""
    return msgspec.json.encode({"model": "any", "messages": messages, **fields})
