"""A full engine queue under priority scheduling (llm_engine/waiting.py, and the engine's use of
it in llm_engine/service.py): a more urgent request is let in past the limit and takes the least
urgent one's place once it is found valid; each request is answered once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from vllm.exceptions import VLLMValidationError

from llm_engine.prompts import InvalidPrompt
from llm_engine.service import EngineService
from llm_engine.waiting import QueueFull, WaitingRequests
from llm_engine.watchdog import StallWatch
from protocol.to_engine import GenerateRequest
from protocol.to_gateway import GenerateFailed
from tests.unit.test_engine_stall_watch import Sent


def room(limit: int, arrivals: list[tuple[str, int]], by_priority: bool = True) -> tuple[WaitingRequests, list[str]]:
    """The queue after the arrivals (request, priority), one a second; and those refused."""
    waiting, refused = WaitingRequests(limit, by_priority), []
    for at, (rid, priority) in enumerate(arrivals):
        if not waiting.admit(rid, priority, float(at)):
            refused.append(rid)
    return waiting, refused


def test_past_the_limit_only_a_request_more_urgent_than_one_waiting_is_let_in_and_then_only_one_for_each():
    _, refused = room(2, [("a", 5), ("b", 0), ("u1", -1), ("u2", -1), ("c", 5), ("u3", -1)])
    assert refused == ["c", "u3"]  # c: none less urgent; u3: the two less urgent (a, b) are spoken for by u1 and u2
    _, refused = room(2, [("a", 0), ("b", 0), ("c", 0)], by_priority=False)
    assert refused == ["c"]  # fcfs: arrival order is the order


def test_a_request_found_valid_takes_the_least_urgent_and_latest_place():
    waiting, _ = room(3, [("a", 5), ("b", 3), ("c", 5), ("urgent", -1)])
    assert waiting.place_for("urgent", lambda rid: True) == "c"
    assert "c" not in waiting and len(waiting) == 3
    assert waiting.place_for("urgent", lambda rid: True) is None  # once


def test_no_place_is_taken_where_room_was_made_or_from_a_request_that_is_ending():
    waiting, _ = room(2, [("a", 5), ("b", 5), ("urgent", -1)])
    waiting.leave("a")
    assert waiting.place_for("urgent", lambda rid: True) is None and len(waiting) == 2
    waiting, _ = room(2, [("a", 5), ("b", 5), ("urgent", -1)])
    assert waiting.place_for("urgent", lambda rid: rid != "b") == "a"
    waiting, _ = room(2, [("a", 5), ("b", 5), ("urgent", -1)])
    with pytest.raises(QueueFull):
        waiting.place_for("urgent", lambda rid: False)
    assert "urgent" not in waiting


class Sampling:
    """A request's SamplingParams as far as the engine's checks go: vLLM's own (`verify`) refuse
    those whose id is in `refused`, as vLLM refuses a structured output's regex that does not compile."""

    def __init__(self, rid: str, refused: frozenset[str]) -> None:
        self.rid, self.refused = rid, refused

    def verify(self, *configs) -> None:
        if self.rid in self.refused:
            raise VLLMValidationError("Invalid regular expression: missing ), unterminated subpattern", parameter="regex")


async def _answers(arrivals: list[tuple[str, int, bool]], stall: bool = False,
                   refused_by_vllm: frozenset[str] = frozenset()) -> list[tuple[str, int, str | None]]:
    """Every answer the requests (id, priority, valid) get from an engine whose queue holds two:
    the valid ones go on to vLLM (here: wait there) once all have come, but for those vLLM's own
    checks refuse (`refused_by_vllm`)."""
    config = SimpleNamespace(served_model_name="m", model="m", stall_timeout_s=600, max_waiting_requests=2,
                             scheduling_policy="priority")
    sent, arrived = Sent(), asyncio.Event()
    processor = SimpleNamespace(model_config=None, speculative_config=None, structured_outputs_config=None, tokenizer=None)
    service = EngineService(config=config, engine=SimpleNamespace(errored=False, input_processor=processor), router=sent,
                            watch=StallWatch(600, 600), shape=None, generation_defaults={}, images=None)
    valid = {rid: ok for rid, _, ok in arrivals}

    def render(request):
        if not valid[request.request_id]:
            raise InvalidPrompt("longer than the model's context")
        return SimpleNamespace(chat=None, reasoning=lambda ids: {}), SimpleNamespace(token_ids=[])

    async def nothing_to_fetch(items):
        await arrived.wait()
        return []

    async def plan(chat, template_prompt, request, tensors):
        return None, Sampling(request.request_id, refused_by_vllm)

    async def in_vllm(peer, rid, prompt, params, *args):
        params.verify()  # vLLM's add_request checks them again
        await asyncio.sleep(600)

    service._read_and_render, service._plan, service._stream = render, plan, in_vllm
    service.images = SimpleNamespace(tensors=nothing_to_fetch)
    try:
        for rid, priority, _ in arrivals:
            await service._accept(b"gateway", GenerateRequest(rid, b"{}", priority=priority), time.monotonic())
        arrived.set()
        await asyncio.sleep(0.2)
        if stall:
            service._fail_in_flight("stalled", "engine_stalled")
            await asyncio.sleep(0.05)
        return [(m.request_id, m.status, m.code) for m in sent.messages if isinstance(m, GenerateFailed)]
    finally:
        for flight in list(service.requests.values()):
            flight.task.cancel()
        service.renderer.shutdown(wait=False, cancel_futures=True)


def test_an_urgent_request_the_engine_refuses_takes_no_one_s_place():
    answers = asyncio.run(_answers([("a", 5, True), ("b", 5, True), ("bad-1", -1, False), ("bad-2", -1, False)]))
    assert sorted(answers) == [("bad-1", 400, None), ("bad-2", 400, None)]


def test_an_urgent_request_vllm_s_own_checks_refuse_takes_no_one_s_place():
    """vLLM checks the sampling (a structured output's regex, the logprobs limit) as the request goes
    in: one it refuses is found invalid before it displaces anyone."""
    answers = asyncio.run(_answers([("a", 5, True), ("b", 5, True), ("bad-regex", -1, True)], refused_by_vllm=frozenset({"bad-regex"})))
    assert answers == [("bad-regex", 400, "invalid_value")]


def test_a_valid_urgent_request_takes_the_least_urgent_place_and_the_displaced_is_answered_once():
    answers = asyncio.run(_answers([("a", 5, True), ("b", 5, True), ("urgent", -1, True), ("bad", -1, False)], stall=True))
    assert ("b", 429, "displaced") in answers and ("bad", 400, None) in answers
    assert [rid for rid, *_ in answers].count("b") == 1  # the stall answers those still in flight, not b again
    assert sorted(rid for rid, status, _ in answers if status == 503) == ["a", "urgent"]
