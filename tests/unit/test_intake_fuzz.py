"""Property-based tests over the decode path: arbitrary and mutated bytes
never escape as anything but a clean APIError (a 4xx), and accepted images
always come out as uint8 (h, w, 3) within the pixel budget."""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from gateway.errors import APIError
from gateway.intake.images import ImageLimits, IntakePolicy, decode, decode_data_url, inspect
from protocol.to_gateway import ProcessorInfo

POLICY = IntakePolicy(ProcessorInfo(14, 2, 3136, 200704), ImageLimits(2_000_000, 4_000_000, 2, 200))


def seeds() -> list[bytes]:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    out = []
    for fmt, kwargs in (("JPEG", {}), ("PNG", {}), ("GIF", {}), ("BMP", {}), ("WEBP", {"lossless": True})):
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **kwargs)
        out.append(buffer.getvalue())
    return out


SEEDS = seeds()


def run_intake(raw: bytes) -> None:
    try:
        item = inspect(raw, "messages[0].content[0]", POLICY, POLICY.default_budget)
        prepared = decode(item, POLICY)
    except APIError as exc:
        assert 400 <= exc.status < 500 and exc.message.startswith("messages[0].content[0]: ")
        return
    h, w, c = prepared.pixels.shape
    assert c == 3 and prepared.pixels.dtype == np.uint8 and h * w <= max(POLICY.processor.max_pixels, 56 * 56 * 4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(raw):
    run_intake(raw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.sampled_from(SEEDS),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=12),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_mutated_valid_images(seed, edits, cut):
    data = bytearray(seed)
    for position, value in edits:
        data[position % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    run_intake(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_data_urls(text):
    try:
        decode_data_url("data:" + text, "messages[0].content[0]", POLICY.limits)
    except APIError as exc:
        assert exc.status in (400, 413)


@settings(max_examples=300, deadline=None)
@example("AAAA=")  # padding after a whole quantum: the standard library takes it, pybase64 alone would not
@given(st.one_of(st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode()),
                 st.text(alphabet="ABCab019+/=-_ \n*é", max_size=40)))
def test_data_urls_decode_as_the_standard_library_does(payload):
    """pybase64 (SIMD) decodes them: the same bytes as `base64`, and the same payloads refused."""
    try:
        expected = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        expected = None
    try:
        got = decode_data_url("data:image/png;base64," + payload, "messages[0].content[0]", POLICY.limits)
    except APIError as exc:
        assert exc.status == 400 and "not valid base64" in exc.message
        got = None
    assert got == expected
