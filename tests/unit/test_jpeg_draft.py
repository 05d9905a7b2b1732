"""JPEG draft decoding (`gateway.jpeg_draft`): a scaled decode that lands on
the same target size, original size and visual-token count as the full
decode, with pixels close to it, EXIF orientation honoured, and its own
cache key (the pixels differ)."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from gateway.intake.images import ImageLimits, IntakePolicy, decode, digest_of, inspect
from loadtest.synthetic import make_image
from protocol.to_gateway import ProcessorInfo, TilesInfo

LIMITS = ImageLimits(20 * 2**20, 50_000_000, 2, 200)
QWEN = IntakePolicy(ProcessorInfo(14, 2, 3136, 140 * 140), LIMITS)
TILES = IntakePolicy(TilesInfo(448, 1, 12, True, 256), LIMITS)


XMP_TURNED = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
              b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')


def jpeg(size: tuple[int, int], orientation: int = 1, xmp: bytes = b"") -> bytes:
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buffer = io.BytesIO()
    make_image("draft", size).save(buffer, "JPEG", quality=90, exif=exif.tobytes(), **({"xmp": xmp} if xmp else {}))
    return buffer.getvalue()


def both(raw: bytes, policy: IntakePolicy):
    drafted = dataclasses.replace(policy, jpeg_draft=True)
    item = inspect(raw, "image", policy, policy.default_budget)
    return (item, decode(item, policy)), (item, decode(inspect(raw, "image", drafted, drafted.default_budget), drafted))


@pytest.mark.parametrize("orientation", [1, 6, 8])
@pytest.mark.parametrize("policy", [QWEN, TILES], ids=["qwen", "tiles"])
def test_draft_lands_on_the_full_decode_geometry(policy, orientation):
    (item, full), (_, draft) = both(jpeg((3840, 2160), orientation), policy)
    assert draft.pixels.shape == full.pixels.shape
    assert draft.original_size == full.original_size == ((2160, 3840) if orientation in (6, 8) else (3840, 2160))
    difference = np.abs(draft.pixels.astype(int) - full.pixels.astype(int)).mean()
    assert 0 < difference < 4, difference  # the same picture, not bit-equal (DCT scaling is not bicubic)


@pytest.mark.parametrize("policy", [QWEN, TILES], ids=["qwen", "tiles"])
def test_an_orientation_only_xmp_carries_turns_a_draft_as_the_full_decode(policy):
    """exif_transpose falls back to XMP's tiff:Orientation where the EXIF has none (as vLLM's does):
    the draft, and the count, know the picture turns too."""
    (item, full), (drafted_item, draft) = both(jpeg((3840, 2160), xmp=XMP_TURNED), policy)
    assert draft.pixels.shape == full.pixels.shape and draft.original_size == full.original_size == (2160, 3840)
    assert drafted_item.visual_tokens == item.visual_tokens == policy.visual_tokens(3840, 2160, policy.target(3840, 2160, policy.default_budget))


def test_draft_is_off_for_small_images_and_other_formats():
    small = jpeg((150, 120))
    (_, full), (_, draft) = both(small, QWEN)
    assert np.array_equal(full.pixels, draft.pixels)  # 1/2 scale would drop below the target: not drafted
    buffer = io.BytesIO()
    make_image("draft", (1920, 1080)).save(buffer, "PNG")
    (_, full), (_, draft) = both(buffer.getvalue(), QWEN)
    assert np.array_equal(full.pixels, draft.pixels)


def test_draft_has_its_own_cache_key():
    raw = jpeg((1920, 1080))
    drafted = dataclasses.replace(QWEN, jpeg_draft=True)
    item = inspect(raw, "image", QWEN, QWEN.default_budget)
    assert digest_of(item, QWEN) != digest_of(item, drafted)
