"""The other model families, each token-for-token equal to vLLM given the raw
images (in-process, float32), on a tiny random-weights checkpoint of the
family's own structure built at test time (prism/tiny_models.py).

Qwen3-VL: its embeddings carry the merger's tokens and each DeepStack
layer's feature side by side; vLLM adds the DeepStack part into the first
LLM layers, so an answer that matches shows both parts arrived intact.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from openai import OpenAI

from cache import content_key
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.stack import LocalStack
from prism.tiny_models import ensure_tiny_model
from protocol.to_gateway import GenerateFailed, TokenDelta
from vision_encoder.tower import VisionTower
from tests.integration.cases import CONCURRENT_IMAGES, PARITY_IMAGES, TEST_MAX_PIXELS
from tests.integration.conftest import STACK_OVERRIDES, Reference
from tests.integration.helpers import ask, embeddings_request, send_raw

FAMILIES = ["qwen3-vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, images):
    checkpoint = ensure_tiny_model(request.param)
    run_dir = tmp_path_factory.mktemp(request.param)
    reference = Reference(run_dir / "reference.json", next(iter(images.values())).parent, run_dir / "reference.log", checkpoint)
    try:
        with LocalStack(run_dir, STACK_OVERRIDES, model=checkpoint) as stack:
            client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
            yield client, reference, stack
    finally:
        if reference.process.poll() is None:
            reference.process.kill()


def test_the_parity_images_include_a_strip_and_images_over_the_budget():
    assert {"strip", "portrait"} <= set(PARITY_IMAGES)
    assert sum(w * h > TEST_MAX_PIXELS for w, h in PARITY_IMAGES.values()) >= 2


@pytest.mark.parametrize("name", list(PARITY_IMAGES))
def test_single_image_matches_vllm(family, images, name):
    client, reference, _ = family
    response = ask(client, f"image-{name}", images)
    expected = reference[f"image-{name}"]
    assert response.choices[0].message.content == expected["text"]
    assert response.usage.prompt_tokens == expected["prompt_tokens"]  # the same visual token count


def test_two_images_and_a_second_turn_match_vllm(family, images):
    client, reference, _ = family
    for case in ("two-images", "two-turns"):
        assert ask(client, case, images).choices[0].message.content == reference[case]["text"], case


def test_eight_concurrent_requests_each_match_vllm(family, images):
    client, reference, _ = family
    names = list(CONCURRENT_IMAGES)[:8]
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: ask(client, f"image-{n}", images).choices[0].message.content, names))
    want = [reference[f"image-{n}"]["text"] for n in names]
    assert got == want and len(set(want)) > 1  # the answers differ, so a mix-up would show


def test_the_checkpoint_s_generation_defaults_apply(family, client):
    """The tiny checkpoints' generation_config.json sets top_k 1: sampled answers no longer depend on the seed.
    The demo checkpoint (`client`) sets no top_k, and there they do."""
    family_client, _, _ = family

    def story(through: OpenAI, seed: int) -> str:
        messages = [{"role": "user", "content": "Write a story."}]
        return through.chat.completions.create(model="prism-demo", messages=messages, max_tokens=12, temperature=1.0, seed=seed).choices[0].message.content

    assert story(family_client, 1) == story(family_client, 2) == story(family_client, 3)
    assert len({story(client, seed) for seed in (1, 2, 3)}) > 1


def test_two_families_given_the_same_image_never_share_a_cache_entry():
    towers = [VisionTower(str(ensure_demo_model(RANDOM_MODEL)), "float32", "cpu")]
    towers += [VisionTower(str(ensure_tiny_model(name)), "float32", "cpu") for name in FAMILIES]
    digest = bytes(range(16))  # one image, as the gateway digests it
    assert len({content_key(tower.fingerprint, digest) for tower in towers}) == len(towers)
    assert len({tower.family.name for tower in towers}) == len(towers)


def test_embeddings_of_plain_hidden_width_are_refused_and_the_engine_lives(family):
    """Qwen3-VL without its DeepStack part: vLLM's engine core would die on it (EngineDeadError for
    every request after); the engine refuses that request alone."""
    client, _, stack = family
    address = stack.engine_addresses[0]
    plain = asyncio.run(send_raw(address, *embeddings_request("deepstack-missing", torch.randn(4, 128), (1, 4, 4))))
    assert isinstance(plain, GenerateFailed) and plain.status == 400 and "expected (4, 384)" in plain.message
    full = asyncio.run(send_raw(address, *embeddings_request("deepstack-ok", torch.randn(4, 384), (1, 4, 4))))
    assert isinstance(full, TokenDelta) and full.completion_tokens == 2
