"""The gateway's video frame plan (gateway/intake/video/sizing.py) against the
encoder's video processors themselves: the frames the gateway resizes must
give the processor's output bit for bit, and the tokens it predicts must be
the processor's grid."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoVideoProcessor

from gateway.intake.resize import resize_pixels
from gateway.intake.video.sizing import plan_frames, processor_frame_size
from protocol.video import VideoKnobs
from vision_encoder.towers.qwen_video import budget_size, video_sizing

CHECKPOINTS = {"Qwen2-VL": "models/prism-shapes", "Qwen2.5-VL": "models/tiny-qwen2.5-vl", "Qwen3-VL": "models/tiny-qwen3-vl"}


def _processor(family: str, **overrides):
    return AutoVideoProcessor.from_pretrained(CHECKPOINTS[family], **overrides)


def _frames(rng: np.random.Generator, t: int, h: int, w: int) -> np.ndarray:
    """Noise over gradients: any difference in resampling shows in the pixels."""
    ramp = np.linspace(0, 255, w, dtype=np.float32)[None, None, :, None]
    noise = rng.integers(0, 64, (t, h, w, 3), dtype=np.int32)
    return np.clip(ramp * 0.7 + noise, 0, 255).astype(np.uint8)


def _run(processor, frames: np.ndarray, knobs: VideoKnobs) -> dict:
    kwargs = {}
    if knobs.min_pixels or knobs.max_pixels:  # as QwenVideo._kwargs passes a request's budget
        kwargs["size"] = budget_size(processor.size, knobs.min_pixels, knobs.max_pixels)
    return processor(videos=[frames], return_tensors="pt", do_sample_frames=False, **kwargs)


# (family, processor overrides, knobs, frames, height, width)
CASES = [
    ("Qwen2-VL", {}, VideoKnobs(), 20, 1080, 1920),
    ("Qwen2-VL", {}, VideoKnobs(max_pixels=16384), 8, 360, 640),
    ("Qwen2-VL", {}, VideoKnobs(), 5, 320, 180),  # portrait, an odd count
    ("Qwen2.5-VL", {}, VideoKnobs(max_pixels=50000), 6, 720, 1280),
    ("Qwen2.5-VL", {"cap_pixels_per_frame": True, "max_video_tokens": 64}, VideoKnobs(), 12, 480, 640),
    ("Qwen3-VL", {}, VideoKnobs(max_pixels=200_000), 10, 720, 1280),
    ("Qwen3-VL", {}, VideoKnobs(max_pixels=400_000), 7, 1080, 1920),
    ("Qwen3-VL", {"cap_pixels_per_frame": True, "max_video_tokens": 40}, VideoKnobs(), 6, 480, 640),
]


@pytest.mark.parametrize("family, overrides, knobs, t, h, w", CASES)
def test_resized_frames_give_the_processors_own_output(family, overrides, knobs, t, h, w):
    processor = _processor(family, **overrides)
    sizing = video_sizing(processor, family)
    plan = plan_frames(sizing, knobs, t, False, h, w)
    assert plan is not None and plan.size is not None and plan.size[0] * plan.size[1] < h * w
    frames = _frames(np.random.default_rng(t * h), t, h, w)
    resized = np.stack([resize_pixels(frame, plan.size[1], plan.size[0]) for frame in frames])
    expected, got = _run(processor, frames, knobs), _run(processor, resized, knobs)
    assert got["video_grid_thw"].tolist() == expected["video_grid_thw"].tolist()
    assert torch.equal(got["pixel_values_videos"], expected["pixel_values_videos"])
    assert plan.visual_tokens == int(expected["video_grid_thw"].prod()) // sizing.merge_size**2


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_planned_tokens_are_the_processors_grid_over_many_sizes(family):
    """Sizes and counts at random, small frames (the processor's sizing, not its pixels, is under test):
    the predicted tokens always equal the processor's, and a planned resize is its own fixed point."""
    rng = random.Random(family)
    processor = _processor(family)
    sizing = video_sizing(processor, family)
    factor = sizing.patch_size * sizing.merge_size
    for _ in range(60):
        t, h, w = rng.randint(2, 9), rng.randint(factor, 300), rng.randint(factor, 300)
        knobs = VideoKnobs(max_pixels=rng.choice([None, 4096, 20000, 90000]))
        if knobs.max_pixels and knobs.max_pixels < processor.size["shortest_edge"]:
            knobs = VideoKnobs()
        plan = plan_frames(sizing, knobs, t, False, h, w)
        grid = _run(processor, np.zeros((t, h, w, 3), np.uint8), knobs)["video_grid_thw"]
        assert plan.visual_tokens == int(grid.prod()) // sizing.merge_size**2, (t, h, w, knobs)
        if plan.size is not None:
            budget = (knobs.min_pixels or sizing.min_pixels, knobs.max_pixels or sizing.max_pixels)
            assert processor_frame_size(sizing, t, *plan.size, *budget) == plan.size


def test_no_plan_where_the_processor_sizes_by_its_own_sample():
    qwen3 = video_sizing(_processor("Qwen3-VL"), "Qwen3-VL")
    assert plan_frames(qwen3, VideoKnobs(), 8, True, 720, 1280) is None  # every frame kept: it samples again
    assert plan_frames(qwen3, VideoKnobs(), 8, False, 720, 1280) is not None
    assert video_sizing(_processor("Qwen2-VL", do_sample_frames=True), "Qwen2-VL") is None  # samples every clip
    assert video_sizing(_processor("Qwen2-VL", resample=2), "Qwen2-VL") is None  # not the gateway's bicubic
    assert plan_frames(None, VideoKnobs(), 8, False, 720, 1280) is None


def test_a_clip_the_budget_does_not_shrink_travels_as_decoded():
    sizing = video_sizing(_processor("Qwen2-VL"), "Qwen2-VL")
    plan = plan_frames(sizing, VideoKnobs(), 4, False, 56, 56)  # below the budget: the processor scales it up
    assert plan.size is None and plan.visual_tokens == 2 * (plan_frames(sizing, VideoKnobs(), 2, False, 56, 56).visual_tokens)
