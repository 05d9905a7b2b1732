"""The encoder's Qwen processors, fed channels-first views with normalize
folded into patchify (vision_encoder/towers/fused_patches.py), against the
unchanged processors on the (h, w, 3) arrays: every image and video, resized
by the processor or already at its size, gives the same patches bit for bit
once cast to the tower's dtype, and the same grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoVideoProcessor

from prism.demo_model import SHAPES_MODEL
from prism.tiny_models import ensure_tiny_model
from vision_encoder.towers.fused_patches import channels_first_view, fuse_normalize_into_patchify

FAMILIES = ["Qwen2-VL", "Qwen2.5-VL", "Qwen3-VL"]


def _checkpoint(family: str) -> str:
    """The demo model for Qwen2-VL (committed); the tiny checkpoints are written on first use."""
    return str(SHAPES_MODEL if family == "Qwen2-VL" else ensure_tiny_model(family.lower()))


def _pixels(seed: int, *shape: int) -> np.ndarray:
    """Noise over a gradient (every channel value in use)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, shape[-2], dtype=np.float32)[:, None]
    return np.clip(ramp * 0.7 + rng.integers(0, 80, shape), 0, 255).astype(np.uint8)


def _both(load, family: str, dtype: torch.dtype):
    own = load(_checkpoint(family))
    return own, fuse_normalize_into_patchify(load(_checkpoint(family)), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", FAMILIES)
def test_images_equal_the_processors_own(family, dtype):
    own, fused = _both(AutoImageProcessor.from_pretrained, family, dtype)
    factor = own.patch_size * own.merge_size
    images = [
        _pixels(1, 4 * factor, 6 * factor, 3),  # at the processor's size: no resize
        _pixels(2, 250, 333, 3),  # resized by the processor
        _pixels(3, 4 * factor, 6 * factor, 3),  # grouped with the first (one stacked patchify)
        _pixels(4, 90, 40, 3),  # portrait
    ]
    expected = own(images=images, return_tensors="pt")
    got = fused(images=[channels_first_view(image) for image in images], input_data_format="channels_first", return_tensors="pt")
    assert got["pixel_values"].dtype == dtype
    assert torch.equal(got["pixel_values"], expected["pixel_values"].to(dtype))
    assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])


@pytest.mark.parametrize("frames, height, width", [(8, 112, 168), (5, 90, 160), (1, 64, 64), (6, 270, 480)])
@pytest.mark.parametrize("family", FAMILIES)
def test_videos_equal_the_processors_own(family, frames, height, width):
    own, fused = _both(AutoVideoProcessor.from_pretrained, family, torch.bfloat16)
    if family == "Qwen3-VL" and frames < own.temporal_patch_size:
        pytest.skip("Qwen3-VL's processor refuses a clip under its temporal patch")
    clip = _pixels(frames * height, frames, height, width, 3)
    kwargs = {"do_sample_frames": False, "return_tensors": "pt"}
    expected = own(videos=[clip], **kwargs)
    got = fused(videos=[channels_first_view(clip)], input_data_format="channels_first", **kwargs)
    assert torch.equal(got["pixel_values_videos"], expected["pixel_values_videos"].to(torch.bfloat16))
    assert torch.equal(got["video_grid_thw"], expected["video_grid_thw"])


def test_anything_but_uint8_takes_the_processors_own_path():
    own, fused = _both(AutoImageProcessor.from_pretrained, "Qwen2-VL", torch.bfloat16)
    image = _pixels(5, 56, 84, 3).astype(np.float32) / 255
    kwargs = {"do_rescale": False, "return_tensors": "pt"}
    expected, got = own(images=[image], **kwargs), fused(images=[image], **kwargs)
    assert torch.equal(got["pixel_values"], expected["pixel_values"].to(torch.bfloat16))
