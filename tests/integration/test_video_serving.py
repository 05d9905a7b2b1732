"""Videos answered through the running stack (gateway → encoder → engine, the
tokens by reference through the images' hand-off), with the official openai
client: the same greedy answer and prompt-token count as vLLM's own raw-video
path on the demo model (tests/integration/reference_video_vllm.py, run once
for this module beside the stack; one clip's frames are over the stack's pixel
budget, which both sides apply to videos), a repeat is an encoder cache hit with the
same answer with no decode at the gateway (it goes by the kept reference),
other processor knobs are not a false hit, a video's tokens count against the
request's visual-token limit, two videos and an image in one request, and the
video stages in the response's breakdown and in Prometheus."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from common.config import REPO_ROOT
from loadtest.clips import clip, make_clip
from prism.demo_model import RANDOM_MODEL
from testing.stack import free_port, log_tail, serving
from tests.integration.conftest import MODEL_NAME
from tests.integration.corpus import b64, save, scene
from tests.integration.helpers import scrape
from tests.integration.reference_video_vllm import CLIP_NAMES, SERVED_CLIPS, MAX_TOKENS, QUESTION


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stack) -> dict:
    """vLLM's answers, started once the stack is up (the two would share two cores while loading)."""
    run_dir = tmp_path_factory.mktemp("video-reference")
    out, log = run_dir / "reference.json", run_dir / "reference.log"
    script = Path(__file__).with_name("reference_video_vllm.py")
    process = subprocess.run([sys.executable, str(script), str(RANDOM_MODEL), str(out)], cwd=REPO_ROOT,
                             stdout=open(log, "wb"), stderr=subprocess.STDOUT, timeout=900)
    if process.returncode != 0:
        raise RuntimeError(f"vLLM video reference failed; the end of {log}:\n{log_tail(log)}")
    return json.loads(out.read_text())


VISUAL_TOKEN_LIMIT = 16  # the small-limit gateway's: fewer than the clip asked for takes


def gateway_with_limit(stack, tmp_path_factory, visual_tokens: int):
    """A second gateway on the stack's encoder and engine, whose requests may take `visual_tokens` visual tokens."""
    port = free_port()
    env = dict(stack.environment(), PRISM_GATEWAY__PORT=str(port),
               PRISM_GATEWAY__MAX_VISUAL_TOKENS_PER_REQUEST=str(visual_tokens))
    log = open(tmp_path_factory.mktemp("visual-token-limit") / "gateway.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    with serving(process, f"http://127.0.0.1:{port}", 120) as base_url:
        yield OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def small_limit(stack, tmp_path_factory):
    yield from gateway_with_limit(stack, tmp_path_factory, VISUAL_TOKEN_LIMIT)


@pytest.fixture(scope="module")
def past_the_context(stack, tmp_path_factory):
    yield from gateway_with_limit(stack, tmp_path_factory, 16384)  # more than the engine's context of 4,096


def data_url(raw: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(raw).decode()}}


def video_part(name: str) -> dict:
    return data_url(make_clip(SERVED_CLIPS[name]))


def ask(client, content: list[dict], max_tokens: int = MAX_TOKENS, **extra):
    return client.chat.completions.create(model=MODEL_NAME, max_tokens=max_tokens, temperature=0,
                                          messages=[{"role": "user", "content": content}], extra_body=extra or None)


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_a_video_is_answered_as_vllm_answers_it_and_a_repeat_is_a_cache_hit(client, reference, name):
    content = [video_part(name), {"type": "text", "text": QUESTION}]
    first, again = ask(client, content), ask(client, content)
    expected = reference[name]
    assert first.choices[0].message.content == expected["text"]
    assert first.usage.prompt_tokens == expected["prompt_tokens"]  # the same visual tokens, by grid
    assert first.usage.completion_tokens == len(expected["token_ids"])
    assert first.model_extra["prism"]["cache"] == {"hits": 0, "misses": 1}
    assert again.model_extra["prism"]["cache"] == {"hits": 1, "misses": 0}
    assert again.choices[0].message.content == expected["text"] and again.usage.prompt_tokens == expected["prompt_tokens"]
    # the repeat went by the kept reference: fetched and inspected, never decoded
    assert first.model_extra["prism"]["stages_ms"]["video_decode"] > 0
    assert again.model_extra["prism"]["stages_ms"].get("video_decode", 0) == 0


def test_a_repeat_with_other_processor_knobs_is_not_a_false_hit(client):
    content = [data_url(clip(320, 240, 10.0, num_frames=20, seed=4601)), {"type": "text", "text": QUESTION}]
    default, again = ask(client, content, max_tokens=2), ask(client, content, max_tokens=2)
    smaller = ask(client, content, max_tokens=2, mm_processor_kwargs={"max_pixels": 100 * 100})
    assert again.model_extra["prism"]["cache"] == {"hits": 1, "misses": 0}
    assert smaller.model_extra["prism"]["cache"] == {"hits": 0, "misses": 1}
    assert smaller.usage.prompt_tokens < default.usage.prompt_tokens  # its own, smaller frames' tokens
    assert smaller.model_extra["prism"]["stages_ms"]["video_decode"] > 0  # asked by key, missing: decoded then


def test_a_video_over_the_visual_token_limit_is_refused_naming_the_limit(small_limit):
    """Refused as planned from the encoder's handshake ("would take"), before its decode or encode."""
    with pytest.raises(openai.APIStatusError) as refused:
        ask(small_limit, [video_part("short"), {"type": "text", "text": QUESTION}], max_tokens=2)
    error = refused.value
    assert error.status_code == 413 and error.body["code"] == "too_many_visual_tokens"
    assert "gateway.max_visual_tokens_per_request" in error.body["message"] and str(VISUAL_TOKEN_LIMIT) in error.body["message"]
    assert "would take at least" in error.body["message"]
    text = ask(small_limit, [{"type": "text", "text": QUESTION}], max_tokens=2)
    assert text.usage.completion_tokens == 2  # the gateway serves on


def test_the_clips_answers_differ(reference):
    """So a video mixed up with another would show."""
    assert len({reference[name]["text"] for name in CLIP_NAMES}) > 1


def test_two_videos_and_an_image_in_one_request(client):
    image = {"type": "image_url", "image_url": {"url": b64(save(scene((64, 48), "beside-videos"), "PNG"))}}
    content = [video_part("odd"), image, video_part("six-seconds"), {"type": "text", "text": "Compare them."}]
    one_video = ask(client, [video_part("odd"), image, {"type": "text", "text": "Compare them."}], max_tokens=4)
    reply = ask(client, content, max_tokens=4)
    assert reply.usage.completion_tokens == 4
    assert reply.usage.prompt_tokens > one_video.usage.prompt_tokens  # the second video's tokens are in the prompt
    assert reply.model_extra["prism"]["cache"]["hits"] + reply.model_extra["prism"]["cache"]["misses"] == 3


def test_the_video_stages_are_in_the_breakdown_and_in_prometheus(client, stack):
    new = data_url(clip(160, 120, 6.0, num_frames=9, seed=4602))  # never sent: a repeat is not decoded
    reply = ask(client, [new, {"type": "text", "text": QUESTION}], max_tokens=2)
    stages = reply.model_extra["prism"]["stages_ms"]
    assert stages["video_fetch"] >= 0 and stages["video_decode"] > 0 and stages["encode"] >= 0
    samples = scrape(stack)
    for stage in ("video_fetch", "video_decode"):
        assert samples[("prism_stage_seconds_count", (("stage", stage),))] >= 1


def test_videos_that_alone_would_fill_the_context_are_refused_before_their_decode(past_the_context):
    """The engine would refuse the prompt once they were decoded and encoded (seconds of work on
    the gateway's intake threads and the encoder); planned from the encoder's handshake, they are
    refused first, as vLLM's server refuses a prompt past the context."""
    hd = data_url(clip(1280, 720, 10.0, duration_s=8, seed=4602))  # 16 frames kept, the most a video may keep here
    with pytest.raises(openai.BadRequestError) as refused:
        ask(past_the_context, [hd, hd, hd, hd, {"type": "text", "text": QUESTION}], max_tokens=2)
    message = refused.value.body["message"]
    assert "maximum context length is 4096 tokens; the images and videos would take at least" in message, message
