"""Videos answered through the running stack (gateway → encoder → engine, the
tokens by reference through the images' hand-off), with the official openai
client: the same greedy answer and prompt-token count as vLLM's own raw-video
path on the demo model (tests/integration/reference_video_vllm.py, run once
for this module beside the stack; one clip's frames are over the stack's pixel
budget, which both sides apply to videos), a repeat is an encoder cache hit with the
same answer, two videos and an image in one request, and the video stages in
the response's breakdown and in Prometheus."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import REPO_ROOT
from loadtest.clips import make_clip
from prism.demo_model import RANDOM_MODEL
from testing.stack import log_tail
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


def video_part(name: str) -> dict:
    raw = make_clip(SERVED_CLIPS[name])
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(raw).decode()}}


def ask(client, content: list[dict], max_tokens: int = MAX_TOKENS):
    return client.chat.completions.create(model=MODEL_NAME, max_tokens=max_tokens, temperature=0,
                                          messages=[{"role": "user", "content": content}])


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
    reply = ask(client, [video_part("odd"), {"type": "text", "text": QUESTION}], max_tokens=2)
    stages = reply.model_extra["prism"]["stages_ms"]
    assert stages["video_fetch"] >= 0 and stages["video_decode"] > 0 and stages["encode"] >= 0
    samples = scrape(stack)
    for stage in ("video_fetch", "video_decode"):
        assert samples[("prism_stage_seconds_count", (("stage", stage),))] >= 1
