"""The trained demo model, served by a stack of its own exactly as `make serve`
runs it: it answers about the image each request sent, at any resolution, and
its held-out accuracy through gateway → encoder → engine stays above the bar;
about a clip, it names the colour a shape turns."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest
from openai import OpenAI
from pydantic import BaseModel

from bench.accuracy import BARS, accuracy, answers, ask, ask_about, held_out, normalise, video_part
from prism import scene_clips, scenes
from prism.demo_model import SHAPES_MODEL
from testing.stack import LocalStack
from loadtest.synthetic import data_url

MODEL = "prism-demo"
CLIP_SEED = "clip-test-2"  # a two-shape clip the committed model answers right both ways, by a margin


@pytest.fixture(scope="module")
def shapes_client(tmp_path_factory):
    stack = LocalStack(tmp_path_factory.mktemp("shapes"), {"PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256"}, model=SHAPES_MODEL)
    stack.start()
    yield OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    stack.stop()


def one_shape_scenes(count: int, seed: str) -> list[scenes.Scene]:
    rng = random.Random(seed)
    return [scenes.make_scene(rng, count=1) for _ in range(count)]


def test_32_concurrent_scenes_each_answered_about_its_own_image(shapes_client):
    # One shape per scene, so "Describe the image." names its colour and its
    # shape; a crossed wire anywhere would answer with another request's scene.
    batch = one_shape_scenes(32, "concurrent")
    assert len({s.describe() for s in batch}) >= 12  # the 32 scenes say different things

    def describe(scene: scenes.Scene) -> str:
        return ask(shapes_client, MODEL, data_url(scene.render(320, 320), "PNG"), "Describe the image.")

    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(describe, batch))
    wrong = [(s.describe(), r) for s, r in zip(batch, replies) if normalise(r) != normalise(s.describe())]
    assert not wrong, wrong


def test_same_scene_at_256_and_4k_gets_the_same_answer(shapes_client):
    rng = random.Random("resolutions")
    for _ in range(3):
        scene = scenes.make_scene(rng, aspect=1.0)
        small = data_url(scene.render(256, 256), "PNG")
        large = data_url(scene.render(4096, 4096), "JPEG")  # the gateway downscales it
        for kind in ("colour", "shape", "count"):
            question = scenes.ask(scene, rng, kind)
            at_256 = ask(shapes_client, MODEL, small, question.text)
            at_4k = ask(shapes_client, MODEL, large, question.text)
            assert normalise(at_256) == normalise(at_4k) == question.answer, (question, at_256, at_4k)


def test_held_out_accuracy_stays_above_the_bar(shapes_client):
    cases = [c for c in held_out(per_kind=40) if c.question.kind in BARS]
    scores = accuracy(cases, answers(shapes_client, MODEL, cases))
    for kind, bar in BARS.items():
        right, asked = scores[kind]
        assert right / asked >= bar, (kind, right, asked)


class SceneShape(BaseModel):
    """The README's example: what the demo model answers in JSON."""

    shape: Literal["circle", "square", "triangle"]
    colour: Literal["red", "green", "blue", "yellow", "orange", "purple"]


def test_parse_with_a_pydantic_model_returns_the_scene_as_an_object(shapes_client):
    rng = random.Random("json")
    for scene in one_shape_scenes(4, "json"):
        (shape,) = scene.shapes
        completion = shapes_client.chat.completions.parse(
            model=MODEL, max_tokens=32, temperature=0, response_format=SceneShape,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(scene.render(*scenes.render_size(scene, rng, 128, 640)), "PNG")}},
                {"type": "text", "text": "Describe the shape in JSON."},
            ]}],
        )
        message = completion.choices[0].message
        assert message.parsed == SceneShape(shape=shape.kind, colour=shape.colour), message.content


def test_ignore_eos_and_min_tokens_are_honoured(shapes_client):
    # The trained model stops after a word; vLLM's extensions make it go on.
    scene = one_shape_scenes(1, "lengths")[0]
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(scene.render(200, 200), "PNG")}},
        {"type": "text", "text": "What colour is the " + scene.shapes[0].kind + "?"},
    ]}]

    def usage(**extra):
        response = shapes_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=extra)
        return response.usage.completion_tokens, response.choices[0].finish_reason

    assert usage() == (2, "stop")  # the colour, then <|im_end|>
    assert usage(ignore_eos=True) == (12, "length")
    tokens, _ = usage(min_tokens=6)
    assert tokens >= 6


def test_a_clip_is_answered_with_the_colour_its_shape_turns_played_either_way(shapes_client):
    # A held-out clip (not from training's generator) in which one shape turns
    # another colour half-way, and the same clip played backwards: the two
    # answers differ, so both are right only if the clip's frames reach the
    # model, in order, as its later temporal patch.
    clip = scene_clips.make_clip(random.Random(CLIP_SEED))
    question = clip.question(random.Random(CLIP_SEED))
    for played in (clip, clip.reversed()):
        reply = ask_about(shapes_client, MODEL, video_part(played.mp4()), question.text)
        assert normalise(reply) == played.colour, (question.text, played.colour, reply)
