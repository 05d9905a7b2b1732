"""Prism's greedy output equals vLLM's own, given the raw image in-process.

Images of mixed sizes: tiny (upscaled by the processor), square, non-square,
portrait, a wide strip, and images over the pixel budget (downscaled by the
gateway before they reach the encoder). float32 on both sides.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.cases import CONCURRENT_IMAGES, PARITY_IMAGES, TEST_MAX_PIXELS
from tests.integration.helpers import ask


def test_some_parity_images_exceed_the_pixel_budget():
    over = [n for n, (w, h) in PARITY_IMAGES.items() if w * h > TEST_MAX_PIXELS]
    assert len(over) >= 2 and len(PARITY_IMAGES) >= 6


@pytest.mark.parametrize("name", list(PARITY_IMAGES))
def test_single_request_matches_vllm(client, images, reference, name):
    response = ask(client, f"image-{name}", images)
    expected = reference[f"image-{name}"]
    assert response.choices[0].message.content == expected["text"]
    assert response.usage.prompt_tokens == expected["prompt_tokens"]  # same visual token count
    assert response.usage.completion_tokens == len(expected["token_ids"])


def test_sixteen_concurrent_requests_each_get_their_own_answer(client, images, reference):
    names = list(CONCURRENT_IMAGES)  # used by no other test: every one is a cache miss
    assert len(names) == 16
    with ThreadPoolExecutor(len(names)) as pool:
        responses = list(pool.map(lambda n: ask(client, f"image-{n}", images), names))
    got = {n: r.choices[0].message.content for n, r in zip(names, responses)}
    want = {n: reference[f"image-{n}"]["text"] for n in names}
    assert got == want
    assert len(set(want.values())) > 1  # the outputs differ, so a mix-up would show
    assert all(r.model_extra["prism"]["cache"] == {"hits": 0, "misses": 1} for r in responses)
