"""What the model's engines cannot do is refused before the request's intake, judged by the
handshake answers of the engines in service: while a rolling change of config goes through them
(a reasoning parser added, a scheduling policy changed), one that can is enough."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from gateway.api.pipeline import check_engine_can
from gateway.api.schemas import ChatCompletionRequest
from gateway.errors import APIError
from gateway.routing.engine_pool import EnginePool
from protocol.to_gateway import EngineReady

BEFORE = EngineReady("m", 4096)
AFTER = EngineReady("m", 4096, scheduling_policy="priority", budgets_thinking=True, keeps_special_tokens=True)
FIELDS = [{"thinking_token_budget": 16}, {"spaces_between_special_tokens": False}, {"priority": -1}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields", FIELDS, ids=["thinking-budget", "special-token-spacing", "priority"])
def test_a_field_no_engine_in_service_can_serve_is_refused_naming_it(fields):
    with pytest.raises(APIError) as caught:
        check_engine_can(request(**fields), [BEFORE])
    assert caught.value.status == 400 and caught.value.param == next(iter(fields))
    check_engine_can(request(**fields), [BEFORE, AFTER])  # one that can is enough


def test_no_thinking_budget_asks_nothing_of_the_engines():
    check_engine_can(request(thinking_token_budget=-1), [BEFORE])  # vLLM reads -1 as none


def test_tools_in_play_leave_special_token_spacing_to_the_engine_whose_tool_parser_may_keep_them():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    check_engine_can(request(spaces_between_special_tokens=False, tools=[tool]), [BEFORE])
    with pytest.raises(APIError):
        check_engine_can(request(spaces_between_special_tokens=False, tools=[tool], tool_choice="none"), [BEFORE])


def test_the_pool_answers_with_the_handshakes_of_its_replicas_in_service():
    async def answers() -> None:
        pool = EnginePool(zmq.asyncio.Context.instance(), ["ipc:///tmp/prism-abilities-a", "ipc:///tmp/prism-abilities-b"], 1.0)
        try:
            pool.info = BEFORE  # the first answer, kept as the one later replicas match on the model
            first, second = pool.replicas
            first.info, second.info = BEFORE, AFTER
            first.up = second.up = True
            assert pool.answers() == [BEFORE, AFTER]
            second.up = False
            assert pool.answers() == [BEFORE]
            first.up = False
            assert pool.answers() == [BEFORE]  # none in service: the pool's own (require_up refuses first)
        finally:
            await pool.close()

    asyncio.run(answers())
