"""A full engine queue under priority scheduling: a more urgent request takes the place of the
least urgent one waiting, which is refused as a full queue refuses (llm_engine/service.py,
`_displace_for`); under fcfs the newcomer is refused."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from llm_engine.prompts import InvalidPrompt
from llm_engine.service import EngineService
from llm_engine.watchdog import StallWatch
from protocol.to_engine import GenerateRequest
from protocol.to_gateway import GenerateFailed
from tests.unit.test_engine_stall_watch import Sent


async def _answers(policy: str, arrivals: list[tuple[str, int]]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Each refusal (request, code) as the requests arrive at a queue of two whose renders are held,
    and who waits at the end."""
    held = threading.Event()
    config = SimpleNamespace(served_model_name="m", model="m", stall_timeout_s=600, max_waiting_requests=2,
                             scheduling_policy=policy)
    sent = Sent()
    service = EngineService(config=config, engine=SimpleNamespace(errored=False), router=sent,
                            watch=StallWatch(600, 600), shape=None, generation_defaults={}, images=None)

    def held_render(request):
        held.wait(5)
        raise InvalidPrompt("released")

    service._read_and_render = held_render
    try:
        for rid, priority in arrivals:
            await service._accept(b"gateway", GenerateRequest(rid, b"{}", priority=priority), time.monotonic())
            await asyncio.sleep(0)  # a displaced request's refusal goes out in the background
        await asyncio.sleep(0.05)
        refused = [(m.request_id, m.code) for m in sent.messages if isinstance(m, GenerateFailed) and m.status == 429]
        return refused, sorted(service.waiting)
    finally:
        held.set()
        service.renderer.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("policy,arrivals,refused,waiting", [
    # the least urgent and, of those, the latest to come gives way; an equal priority displaces none
    ("priority", [("a", 5), ("b", 5), ("urgent", -1), ("c", 5), ("urgent-2", -1), ("urgent-3", -1)],
     [("b", "displaced"), ("c", None), ("a", "displaced"), ("urgent-3", None)], ["urgent", "urgent-2"]),
    ("priority", [("a", 0), ("b", 3), ("c", 1)], [("b", "displaced")], ["a", "c"]),
    ("fcfs", [("a", 0), ("b", 0), ("c", 0)], [("c", None)], ["a", "b"]),
], ids=["urgent-displaces", "least-urgent-first", "fcfs-refuses-the-newcomer"])
def test_a_full_queue_makes_room_for_a_more_urgent_request_only_where_vllm_schedules_by_priority(policy, arrivals, refused, waiting):
    assert asyncio.run(_answers(policy, arrivals)) == (refused, waiting)
