"""The engine's stall watch waits on vLLM's steps only for requests vLLM holds: requests
still rendering (one thread renders them all, and a huge prompt takes seconds) or fetching
their visual tokens are not vLLM's, and a queue of them is no stall
(llm_engine/service.py, `_in_vllm`)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from llm_engine.prompts import InvalidPrompt
from llm_engine.service import EngineService
from llm_engine.watchdog import StallWatch
from protocol.to_engine import GenerateRequest
from protocol.to_gateway import GenerateFailed

STALL_TIMEOUT_S = 0.05


class Sent:
    """The router's place: what the service sends, kept."""

    def __init__(self) -> None:
        self.messages: list = []

    async def send(self, peer, message, wait=True, wait_s=None) -> None:
        self.messages.append(message)


async def _stalled_while_rendering() -> tuple[bool, list]:
    """Whether the watch called a stall while requests waited for their render, and what they were answered."""
    rendered = threading.Event()
    config = SimpleNamespace(served_model_name="m", model="m", stall_timeout_s=STALL_TIMEOUT_S, max_waiting_requests=8,
                             scheduling_policy="fcfs")
    sent = Sent()
    service = EngineService(config=config, engine=SimpleNamespace(errored=False), router=sent,
                            watch=StallWatch(STALL_TIMEOUT_S, 600), shape=None, generation_defaults={}, images=None)

    def slow_render(request):  # a long prompt: its render holds the one thread, the others queue behind
        rendered.wait(5)
        raise InvalidPrompt("longer than the model's context")

    service._read_and_render = slow_render
    watching = asyncio.create_task(service._watch())
    try:
        for i in range(3):
            await service._accept(b"gateway", GenerateRequest(f"r{i}", b"{}"), time.monotonic())
        tasks = [request.task for request in service.requests.values()]
        await asyncio.sleep(10 * STALL_TIMEOUT_S)  # many watch rounds past the stall timeout
        stalled = service.watch.stalled
        rendered.set()
        await asyncio.wait(tasks, timeout=5)
        return stalled, sent.messages
    finally:
        watching.cancel()
        service.renderer.shutdown(wait=False, cancel_futures=True)


def test_requests_waiting_for_their_render_are_no_stall():
    stalled, answers = asyncio.run(_stalled_while_rendering())
    assert not stalled
    assert [(type(m), m.status) for m in answers] == [(GenerateFailed, 400)] * 3  # refused, not failed as stalled (503)
