"""Bad requests get a clear error in OpenAI's shape, and the service keeps serving.

Image-level bad input is covered by the corpus in test_intake.py."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from tests.integration.conftest import MODEL_NAME


def png_url(size=(64, 48)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


UNRESOLVED = "https://no-such-host.invalid/cat.png"

BAD_REQUESTS = [
    ("unsupported-field", body(best_of=2), 400, "best_of"),
    ("tool-without-function", body(tools=[{"type": "function"}]), 400, "function"),
    ("temperature", body(temperature=5), 400, "temperature"),
    ("max-tokens-zero", body(max_tokens=0), 400, "max_tokens"),
    ("min-over-max-tokens", body(min_tokens=5), 400, "min_tokens (5) exceeds max_tokens (2)"),
    ("no-messages", body(messages=[]), 400, "messages"),
    ("empty-stop", body(stop=[""]), 400, "stop sequences must not be empty"),
    ("bad-role", body(messages=[{"role": "robot", "content": "x"}]), 400, "role"),
    ("unknown-model", body(model="gpt-nothing"), 404, "gpt-nothing"),
    # As a host that resolves to a private address is answered: a client cannot map the gateway's network.
    ("unresolvable-host", body(messages=image_message(UNRESOLVED)), 400, "does not resolve to a public address"),
    ("too-many-images", body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url()}}] * 9}]), 400, "the limit is 8 (gateway.max_images_per_request)"),
    ("max-tokens-over-the-context", body(max_tokens=4097), 400, "max_tokens=4097 cannot be greater than this model's context length"),
    # Refused before it is tokenized: that held the engine's rendering thread, and every request behind it, for seconds.
    ("text-no-context-could-hold", body(messages=[{"role": "user", "content": "a" * 2_000_000}]), 400,
     "characters; one that fits this model's context has at most"),
    ("stream-options-without-stream", body(stream_options={"include_usage": True}), 400, "stream_options needs stream: true"),
    ("two-output-constraints", body(response_format={"type": "json_object"}, structured_outputs={"regex": "a+"}), 400, "send one"),
    # What vLLM's engine would refuse after the image's fetch and encode: refused before them.
    ("greedy-n", body(messages=image_message(png_url()), temperature=0, n=2), 400, "temperature 0 (greedy)"),
    ("tool-choice-without-tools", body(tool_choice="auto"), 400, "tool_choice 'auto' needs tools"),
    # Each error names the field as the request spells it, in the union branch the value took.
    ("image-url-as-string", body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": png_url()}]}]), 400,
     "'messages.0.content.0.image_url': Input should be an object"),
    ("image-without-url", body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400,
     "'messages.0.content.0.image_url.url': Field required"),
    ("tool-choice-without-function", body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function"}),
     400, "'tool_choice.function': Field required"),
    # Values OpenAI defines that Prism does not serve: 400, naming them.
    ("original-detail", body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(), "detail": "original"}}]}]),
     400, "'original' (no downscaling) is not served"),
    ("audio-out", body(modalities=["text", "audio"]), 400, "text only"),
    ("unknown-reasoning-effort", body(reasoning_effort="extreme"), 400, "reasoning_effort"),
    # The demo engine has no reasoning parser to tell the reasoning from the answer.
    ("reasoning-hidden-without-a-parser", body(include_reasoning=False), 400, "include_reasoning: this engine has no reasoning parser"),
    # What the demo engine's parsers cannot do (EngineReady), refused before an image is fetched (this host would
    # not resolve): skipped special tokens leave nothing to space (qwen3's reasoning parser keeps them:
    # test_text_only.py), and no reasoning parser can end a reasoning.
    ("special-token-spacing-with-them-skipped", body(spaces_between_special_tokens=False, messages=image_message(UNRESOLVED)), 400,
     "spaces_between_special_tokens: it only changes the text where special tokens are kept"),
    ("thinking-budget-without-a-parser", body(thinking_token_budget=4, messages=image_message(UNRESOLVED)), 400,
     "thinking_token_budget: this model's engines cannot end its reasoning"),
    ("a-bad-word-of-no-token", body(bad_words=[" "]), 400, "bad_words"),
    ("an-allowed-token-outside-the-vocabulary", body(allowed_token_ids=[10**9]), 400, "allowed_token_ids"),
    ("a-refusal-in-history", body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "refusal": "no"}]),
     400, "refusal"),
]


@pytest.mark.parametrize("payload,status,needle", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_clear_error_then_service_still_serves(stack, payload, status, needle):
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    ok = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(messages=image_message(png_url())), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_body_of_more_json_objects_than_the_limit_is_refused_before_it_is_parsed(stack):
    """150,000 empty text parts in 4 MB: parsed, some 150 MB of Python objects and a second of the
    event loop; three such bodies at once, the gateway's whole memory."""
    parts = b",".join([b'{"type":"text","text":""}'] * 150_000)
    content = b'{"model":"%s","messages":[{"role":"user","content":[%s]}]}' % (MODEL_NAME.encode(), parts)
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", content=content, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large" and "gateway.max_json_containers" in response.text
    ok = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(messages=image_message(png_url())), timeout=60)
    assert ok.status_code == 200


def test_a_request_naming_no_model_gets_the_one_served_as_on_vllm_s_server(stack):
    unnamed = {key: value for key, value in body(temperature=0).items() if key != "model"}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=unnamed, timeout=60)
    assert response.status_code == 200 and response.json()["model"] == MODEL_NAME, response.text


def test_malformed_json_is_400(stack):
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


NO_OPS = dict(
    user="u-1", safety_identifier="s-1", metadata={"k": "v"}, store=False, service_tier="auto", modalities=["text"],
    prompt_cache_key="k", prompt_cache_retention="24h", prompt_cache_options={"mode": "explicit", "ttl": "30m"},
    messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {"ttl": "30m"}}]}],
)
# What OpenAI's clients send for what they leave unset: null, whatever the field.
NULLS = dict(n=None, stream=None, logprobs=None, audio=None, prediction=None, reasoning_effort=None, verbosity=None,
             web_search_options=None, functions=None, function_call=None, moderation=None, stop=None)


@pytest.mark.parametrize("fields", [NO_OPS, NULLS], ids=["no-ops", "nulls"])
def test_fields_that_change_nothing_are_accepted_and_answer_as_without_them(stack, fields):
    """Greedy, so the same answer as the request without them: they reach the engine as nothing."""
    plain = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(temperature=0), timeout=60)
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(temperature=0, **fields), timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


def test_an_answer_sent_back_as_history_is_taken_as_the_sdk_sends_it(client):
    """`messages.append(reply.model_dump())`: the SDK's null refusal, audio,
    function_call and annotations ride along; so does `reasoning`, which Prism
    itself answers with when engine.reasoning_parser is set."""
    question = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=question, max_tokens=2, temperature=0).choices[0].message
    sent_back = reply.model_dump() | {"reasoning": "thought about it"}
    assert {"refusal", "audio", "function_call", "annotations"} <= sent_back.keys()
    again = client.chat.completions.create(model=MODEL_NAME, messages=[*question, sent_back, {"role": "user", "content": "more"}],
                                           max_tokens=2, temperature=0)
    assert again.usage.completion_tokens == 2
