"""The gateway's pixel budget and resize must be the processor's, exactly."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

from gateway.intake.images import ImageLimits, IntakePolicy, decode, inspect
from gateway.intake.resize import smart_resize
from prism.demo_model import SHAPES_MODEL
from loadtest.synthetic import make_image
from protocol.to_gateway import ProcessorInfo

SIZES = [(1, 1), (24, 32), (224, 224), (480, 640), (700, 300), (1080, 1920), (2160, 3840), (20, 3000), (5000, 30)]


@pytest.mark.parametrize("height,width", SIZES)
@pytest.mark.parametrize("min_pixels,max_pixels", [(3136, 1048576), (784, 200704), (3136, 12845056)])
def test_matches_transformers(height, width, min_pixels, max_pixels):
    ours = smart_resize(height, width, 28, min_pixels, max_pixels)
    assert ours == hf_smart_resize(height, width, 28, min_pixels, max_pixels)
    h, w = ours
    assert h % 28 == 0 and w % 28 == 0 and h * w <= max(max_pixels, 28 * 28)


def test_extreme_aspect_ratio_is_refused_like_transformers():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 20000, 28, 3136, 1048576)
    with pytest.raises(ValueError):
        hf_smart_resize(1, 20000, 28, 3136, 1048576)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("width,height", [(640, 480), (300, 700), (1920, 1080), (2000, 150)])
def test_an_image_the_gateway_scales_down_reaches_the_vit_as_the_processor_makes_it(width, height, fmt):
    """vLLM gives its processor the whole image; Prism's processor gets the
    gateway's scaled-down pixels. Both must come out the same, bit for bit."""
    processor = AutoImageProcessor.from_pretrained(SHAPES_MODEL)
    info = ProcessorInfo(processor.patch_size, processor.merge_size, processor.size["shortest_edge"], processor.size["longest_edge"])
    policy = IntakePolicy(info, ImageLimits(20 * 2**20, 50_000_000, 2, 200))
    buffer = io.BytesIO()
    make_image(f"resize-{width}x{height}", (width, height)).save(buffer, format=fmt)
    raw = buffer.getvalue()
    prepared = decode(inspect(raw, "image", policy, policy.default_budget), policy)
    assert prepared.pixels.shape[0] * prepared.pixels.shape[1] < width * height  # the gateway did scale it down
    whole = Image.open(io.BytesIO(raw)).convert("RGB")
    expected = processor(images=[whole], return_tensors="pt")
    got = processor(images=[prepared.pixels], return_tensors="pt")
    assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(got["pixel_values"], expected["pixel_values"])
