"""schemathesis against the gateway's own OpenAPI schema: no input it can
generate gets a 5xx, and the service keeps serving."""

from __future__ import annotations

import collections

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.integration.conftest import MODEL_NAME


# The structured-output, tool, logprob and choice fields, fuzzed on their own
# (beside a fixed text conversation) so that they get most of the examples.
CHAT_FEATURES = (
    "n", "logprobs", "top_logprobs", "response_format", "structured_outputs", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template_kwargs", "seed", "temperature",
)


def test_no_generated_request_gets_a_server_error(stack):
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json")
    fuzz(stack, [result.ok() for result in schema.get_all_operations()], chat_examples=120)


def test_no_generated_chat_feature_gets_a_server_error(stack):
    document = httpx.get(f"{stack.base_url}/openapi.json", timeout=10).json()
    request = document["components"]["schemas"]["ChatCompletionRequest"]
    request["properties"] = {k: v for k, v in request["properties"].items() if k in ("model", "messages", *CHAT_FEATURES)}
    request["required"] = ["model", "messages"]
    document["paths"] = {"/v1/chat/completions": document["paths"]["/v1/chat/completions"]}
    schema = schemathesis.openapi.from_dict(document)
    fuzz(stack, [result.ok() for result in schema.get_all_operations()], chat_examples=150, fixed_messages=True)


def fuzz(stack, operations, chat_examples: int, fixed_messages: bool = False) -> None:
    assert any(op.path == "/v1/chat/completions" for op in operations)
    failures: list[str] = []
    statuses: list[int] = []
    for operation in operations:
        examples = chat_examples if operation.path == "/v1/chat/completions" else 10

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case):
            if isinstance(case.body, dict):
                if isinstance(case.body.get("model"), str):
                    case.body["model"] = MODEL_NAME  # past the model check, into the deeper paths
                for field in ("max_tokens", "max_completion_tokens"):  # keep generations short
                    if isinstance(case.body.get(field), int):
                        case.body[field] = min(case.body[field], 8)
                if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
                    case.body["max_tokens"] = 8
                if fixed_messages:
                    case.body["messages"] = [{"role": "user", "content": "hi"}]
            response = case.call(base_url=stack.base_url, timeout=60)
            statuses.append(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{operation.method} {operation.path} {str(case.body)[:1500]} → {response.status_code}: {response.text[:200]}")

        call()
    assert not failures, "\n".join(failures[:5])
    counts = sorted(collections.Counter(statuses).items())
    print(counts)
    # Valid and invalid requests were both generated.
    assert any(200 <= s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses), counts
    ok = httpx.post(f"{stack.base_url}/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert ok.status_code == 200
