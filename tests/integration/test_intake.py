"""Image intake against the running stack: a corpus of bad and odd inputs,
each answered as it should be, with the service still serving after each."""

from __future__ import annotations

import io
import re

import httpx
import pytest
from PIL import Image

from tests.integration.conftest import MAX_BODY_BYTES, MAX_IMAGE_BYTES, MODEL_NAME
from tests.integration.helpers import metric_total
from tests.integration.corpus import animated_gif, b64, bad_samples, exif_rotated_png, odd_valid_samples, save, scene

BAD = bad_samples(MAX_IMAGE_BYTES)
ODD = odd_valid_samples()


def chat(stack, content, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": content}], **fields}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)


def image_then_text(url: str, detail: str = "auto") -> list[dict]:
    return [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url, "detail": detail}}, {"type": "text", "text": "What is it?"}]


def assert_still_serving(stack) -> None:
    ok = chat(stack, image_then_text(b64(save(scene((64, 48), "after"), "PNG"))), max_tokens=1)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_corpus_is_large_enough():
    assert len(BAD) + len(ODD) >= 30


@pytest.mark.parametrize("sample", BAD, ids=[s.name for s in BAD])
def test_bad_image_gets_its_status_and_a_message_naming_it(stack, sample):
    response = chat(stack, image_then_text(sample.url))
    assert response.status_code == sample.status, response.text
    error = response.json()["error"]
    assert error["message"].startswith("messages[0].content[1]: ")
    assert sample.needle in error["message"]
    assert error["param"] == "messages[0].content[1]"
    assert_still_serving(stack)


@pytest.mark.parametrize("sample", ODD, ids=[s.name for s in ODD])
def test_odd_but_valid_image_is_served(stack, sample):
    response = chat(stack, image_then_text(sample.url))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert_still_serving(stack)


def rotated_back(png: bytes) -> bytes:
    """The same pixels as stored, unturned."""
    return save(Image.open(io.BytesIO(png)).transpose(Image.Transpose.ROTATE_90), "PNG")


def answer(stack, url: str) -> dict:
    response = chat(stack, image_then_text(url), max_tokens=8)
    assert response.status_code == 200, response.text
    return {"text": response.json()["choices"][0]["message"]["content"], "prompt_tokens": response.json()["usage"]["prompt_tokens"]}


def test_exif_orientation_is_applied(stack):
    tagged, rotated = exif_rotated_png()
    assert answer(stack, b64(tagged)) == answer(stack, b64(rotated))
    assert answer(stack, b64(tagged)) != answer(stack, b64(rotated_back(rotated)))  # the turn shows in the answer


def test_animated_gif_is_read_as_its_first_frame(stack):
    gif, first_frame, second_frame = animated_gif()
    assert answer(stack, b64(gif, "image/gif")) == answer(stack, b64(first_frame))
    assert answer(stack, b64(gif, "image/gif")) != answer(stack, b64(second_frame))  # the frame shows in the answer


def test_detail_low_and_per_request_budget_cost_fewer_tokens(stack):
    url = b64(save(scene((640, 480), "detail"), "PNG"))
    high = chat(stack, image_then_text(url, "high")).json()["usage"]["prompt_tokens"]
    auto = chat(stack, image_then_text(url, "auto")).json()["usage"]["prompt_tokens"]
    low = chat(stack, image_then_text(url, "low")).json()["usage"]["prompt_tokens"]
    narrowed = chat(stack, image_then_text(url), mm_processor_kwargs={"max_pixels": 100352}).json()["usage"]["prompt_tokens"]
    assert high == auto > narrowed > low  # low: 50176 px, narrowed: 100352 px


def test_per_request_budget_outside_deployment_bounds_is_400(stack):
    url = b64(save(scene((64, 48), "bounds"), "PNG"))
    response = chat(stack, image_then_text(url), mm_processor_kwargs={"max_pixels": 10**9})
    assert response.status_code == 400 and "within the deployment's" in response.json()["error"]["message"]
    response = chat(stack, image_then_text(url), mm_processor_kwargs={"do_resize": False})
    assert response.status_code == 400 and "mm_processor_kwargs.do_resize" in response.json()["error"]["message"]


def test_visual_token_budget_is_checked_before_encoding(stack):
    url = b64(save(scene((640, 480), "tokens"), "PNG"))  # 256 visual tokens at the test budget
    encodes = metric_total(stack, "prism_encoder_replica_requests_total")
    response = chat(stack, [{"type": "image_url", "image_url": {"url": url}}] * 5)
    assert response.status_code == 413 and metric_total(stack, "prism_encoder_replica_requests_total") == encodes
    assert re.search(r"would take \d+ visual tokens; the limit per request is 1024", response.json()["error"]["message"])
    assert_still_serving(stack)


def test_oversized_body_is_413(stack):
    big = "x" * (MAX_BODY_BYTES + 1)
    response = chat(stack, [{"type": "text", "text": big}])
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    assert_still_serving(stack)


def test_unsupported_content_part_is_400(stack):
    response = chat(stack, [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
    assert response.status_code == 400 and "input_audio" in response.json()["error"]["message"]
