"""Small helpers shared by the integration tests."""

from __future__ import annotations

import json

from openai import OpenAI

from tests.integration.cases import CASES
from tests.integration.conftest import MODEL_NAME


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
