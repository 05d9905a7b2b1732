"""The gateway's visual-token count of an image equals the placeholder count
vLLM puts in the prompt (grid t·h·w / merge², from the family's own HF
processor), for 50 random sizes per family. The gateway computes it from the
image's header and the processor numbers the encoder's handshake gives it."""

from __future__ import annotations

import random

import numpy as np
import pytest
from transformers import AutoImageProcessor

from gateway.intake import IntakePolicy, Inspected, ImageLimits, PixelBudget
from gateway.resize import smart_resize
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.tiny_models import ensure_tiny_model
from protocol.to_gateway import ProcessorInfo

CHECKPOINTS = {"qwen2-vl": lambda: ensure_demo_model(RANDOM_MODEL), "qwen3-vl": lambda: ensure_tiny_model("qwen3-vl")}


def random_sizes(seed: int, count: int = 50) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes = []
    while len(sizes) < count:
        height, width = rng.randint(8, 2400), rng.randint(8, 2400)
        if max(height, width) / min(height, width) <= 200:
            sizes.append((height, width))
    return sizes


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_the_gateway_counts_the_placeholders_vllm_will_expand(family):
    processor = AutoImageProcessor.from_pretrained(CHECKPOINTS[family]())
    info = ProcessorInfo(processor.patch_size, processor.merge_size, processor.size["shortest_edge"], processor.size["longest_edge"])
    policy = IntakePolicy(info, ImageLimits(1, 1, 1, 200))
    for height, width in random_sizes(seed=len(family)):
        target = smart_resize(height, width, policy.factor, info.min_pixels, info.max_pixels)
        ours = Inspected(b"", "image", "PNG", (width, height), PixelBudget(info.min_pixels, info.max_pixels), target, policy.factor)
        grid = processor(images=[np.zeros((height, width, 3), np.uint8)], return_tensors="np")["image_grid_thw"][0]
        assert ours.visual_tokens == int(np.prod(grid)) // processor.merge_size**2, (family, height, width)
