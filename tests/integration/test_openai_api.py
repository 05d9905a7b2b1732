"""The official openai client against the running stack."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from tests.integration.cases import CASES
from tests.integration.conftest import MODEL_NAME
from tests.integration.helpers import ask


def test_models_lists_the_served_model(client):
    (card,) = client.models.list().data
    assert card.id == MODEL_NAME
    # vLLM's server's card: clients size their requests by the context length
    assert card.max_model_len == 4096 and card.created > 0 and card.root and card.parent is None


def test_non_streaming_image_request_is_well_formed(client, images, reference):
    response = ask(client, "image-square", images)
    expected = reference["image-square"]
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == MODEL_NAME
    assert choice.message.role == "assistant" and choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"] == "length"
    assert response.usage.prompt_tokens == expected["prompt_tokens"]
    assert response.usage.completion_tokens == len(expected["token_ids"]) == CASES["image-square"].max_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streaming_gives_the_same_text_and_usage(client, images, reference):
    case = CASES["image-portrait"]
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=case.openai_messages(images), max_tokens=case.max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == reference["image-portrait"]["text"]
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == reference["image-portrait"]["prompt_tokens"]
    assert usage.completion_tokens == case.max_tokens


def test_raw_sse_stream_ends_with_done(stack, images):
    body = {
        "model": MODEL_NAME, "stream": True, "max_tokens": 3,
        "messages": CASES["image-tiny"].openai_messages(images),
    }
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and len(events) >= 3


@pytest.mark.parametrize("case", ["two-images", "text-only", "two-turns"])
def test_conversation_shapes_match_vllm(client, images, reference, case):
    response = ask(client, case, images)
    assert response.choices[0].message.content == reference[case]["text"]
    assert response.usage.prompt_tokens == reference[case]["prompt_tokens"]
    assert response.usage.completion_tokens == len(reference[case]["token_ids"])


def test_max_completion_tokens_and_stop_are_honoured(client, images, reference):
    short = ask(client, "image-square", images, max_tokens=None, max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    full = reference["image-square"]["text"]
    # two characters met first where they stand, past the first: the answer stops just before them
    stop = next(full[i:i + 2] for i in range(1, len(full) - 1) if full[i:i + 2].strip() and full.index(full[i:i + 2]) == i)
    stopped = ask(client, "image-square", images, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible(client, images):
    first = ask(client, "image-odd", images, temperature=1.0, top_p=0.9, seed=7)
    second = ask(client, "image-odd", images, temperature=1.0, top_p=0.9, seed=7)
    assert first.choices[0].message.content == second.choices[0].message.content
    others = {ask(client, "image-odd", images, temperature=1.0, top_p=0.9, seed=seed).choices[0].message.content for seed in (8, 9, 10)}
    assert others - {first.choices[0].message.content}  # the seed, not greedy decoding, made them equal


def test_usage_counts_prefix_cache_hits_and_image_tokens(client, images):
    long_prompt = f"{uuid.uuid4().hex} " + "Describe a red circle on a blue background. " * 40  # several KV blocks, new to the cache
    first, again = (client.chat.completions.create(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": long_prompt}])
                    for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.model_dump()["image_tokens"] == 0
    with_image = ask(client, "image-landscape", images)
    image_tokens = with_image.usage.prompt_tokens_details.model_dump()["image_tokens"]
    text_only = ask(client, "text-only", images)
    assert 0 < image_tokens < with_image.usage.prompt_tokens and text_only.usage.prompt_tokens_details.model_dump()["image_tokens"] == 0


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=10, stream=True, messages=[{"role": "user", "content": "Tell me a story."}],
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},  # the demo model may sample its end early; the count must reach 10
    )
    chunks = list(stream)
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert counted and counted == sorted(counted) and all(c.usage is not None for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_continuous_usage_counts_each_chunks_own_choice_and_needs_include_usage(client):
    """As vLLM's server: a chunk's usage counts the tokens its choice has made;
    the final usage chunk counts all choices. continuous_usage_stats alone, which vLLM's server
    quietly ignores, is a 400 naming it."""
    def chunks(**stream_options):
        return list(client.chat.completions.create(
            model=MODEL_NAME, max_tokens=6, n=2, seed=3, temperature=1.0, stream=True, messages=[{"role": "user", "content": "Tell me a story."}],
            stream_options=stream_options, extra_body={"ignore_eos": True}))

    continuous = chunks(include_usage=True, continuous_usage_stats=True)
    last_of = {c.choices[0].index: c.usage.completion_tokens for c in continuous if c.choices}
    assert last_of == {0: 6, 1: 6} and continuous[-1].usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match="continuous_usage_stats needs include_usage"):
        chunks(continuous_usage_stats=True)


def test_an_idle_keep_alive_connection_outlasts_the_clients_own_expiry(stack):
    # httpx (so the openai client) reuses a connection idle for up to 5 s; a
    # server closing it at the same moment fails the next request with
    # "Server disconnected". One HTTP/1.1 connection, idle 6 s, then reused.
    with httpx.Client(base_url=stack.base_url, limits=httpx.Limits(keepalive_expiry=60)) as http:
        first = http.get("/health")
        peer = first.extensions["network_stream"].get_extra_info("client_addr")
        time.sleep(6)  # the idle time is the behaviour under test
        second = http.get("/health")
        assert first.status_code == second.status_code == 200
        assert second.extensions["network_stream"].get_extra_info("client_addr") == peer  # the same connection


def test_a_cache_salt_keeps_a_request_s_prefix_and_visual_tokens_apart_from_other_salts(client):
    """vLLM's `cache_salt`: a tenant whose salt differs finds neither the prompt prefix (vLLM's prefix
    cache) nor the image's tokens (the encoders', engines' and gateway's caches) another one left."""
    from PIL import Image

    from loadtest.synthetic import data_url

    seed = uuid.uuid4()
    image = data_url(Image.new("RGB", (96, 64), tuple(seed.bytes[:3])), "PNG")  # new to every cache
    text = f"{seed.hex} " + "Describe the shapes and their colours. " * 30  # several KV blocks

    def caches(parts: list[dict], **salt) -> tuple[int, dict]:
        response = client.chat.completions.create(model=MODEL_NAME, max_tokens=1, extra_body=salt,
                                                  messages=[{"role": "user", "content": parts}])
        return response.usage.prompt_tokens_details.cached_tokens, response.model_extra["prism"]["cache"]

    words = [{"type": "text", "text": text}]
    assert caches(words, cache_salt="tenant-a")[0] == 0
    assert caches(words, cache_salt="tenant-a")[0] > 0
    assert caches(words, cache_salt="tenant-b")[0] == caches(words)[0] == 0
    picture = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]
    assert caches(picture, cache_salt="tenant-a")[1] == {"hits": 0, "misses": 1}
    assert caches(picture, cache_salt="tenant-a")[1] == {"hits": 1, "misses": 0}
    assert caches(picture, cache_salt="tenant-b")[1] == caches(picture)[1] == {"hits": 0, "misses": 1}
    with pytest.raises(openai.BadRequestError, match="cache_salt must not contain"):
        caches(words, cache_salt="tenant/a")
