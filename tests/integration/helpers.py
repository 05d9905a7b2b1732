"""Small helpers shared by the integration tests."""

from __future__ import annotations

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
