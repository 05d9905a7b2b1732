"""Patch embeddings run as one matmul (vision_encoder/towers/patch_matmul.py): the
same numbers as the convolution, and every family's tower gets it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.tiny_models import ensure_tiny_model
from vision_encoder.towers.patch_matmul import PatchMatmul, patch_convs_as_matmul
from vision_encoder.towers import load_tower

CPU = torch.device("cpu")


@pytest.mark.parametrize("conv, shape", [
    (nn.Conv3d(3, 64, (2, 14, 14), (2, 14, 14), bias=False), (37, 3, 2, 14, 14)),  # Qwen2-VL's: one patch per row
    (nn.Conv3d(3, 32, (2, 14, 14), (2, 14, 14)), (2, 3, 4, 42, 56)),  # several patches per axis, with bias
    (nn.Conv2d(3, 48, 14, 14), (2, 3, 70, 98)),  # CLIP's and InternViT's
    (nn.Conv2d(3, 48, 14, 14, padding="valid"), (2, 3, 28, 42)),  # SigLIP's spelling of no padding
    (nn.Conv2d(3, 48, 14, 14), (1, 3, 75, 100)),  # sizes the kernel does not divide: the remainder is dropped, as conv does
])
def test_the_matmul_gives_the_convolution_s_numbers(conv, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    with torch.inference_mode():
        expected = conv(x)
        got = PatchMatmul(conv)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_only_non_overlapping_convolutions_are_swapped():
    model = nn.Sequential(nn.Conv2d(3, 8, 14, 14), nn.Conv2d(8, 8, 3, 1, padding=1), nn.Conv2d(8, 8, 2, 2, groups=2),
                          nn.Conv3d(8, 8, 2, 2, padding=1), nn.Conv2d(8, 8, 3, 1, padding="same"), nn.Sequential(nn.Conv3d(3, 8, 2, 2)))
    assert patch_convs_as_matmul(model, CPU) == 2
    kinds = [type(m).__name__ for m in (*model[:5], model[5][0])]
    assert kinds == ["PatchMatmul", "Conv2d", "Conv2d", "Conv3d", "Conv2d", "PatchMatmul"]
    assert model[0].weight.dtype == torch.float32  # towers read the patch embedding's weight dtype


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava-onevision", "llava-next", "internvl3"])
def test_every_family_s_tower_embeds_patches_by_matmul(family):
    checkpoint = ensure_demo_model(RANDOM_MODEL) if family == "qwen2-vl" else ensure_tiny_model(family)
    tower = load_tower(str(checkpoint), "bfloat16", "cpu")
    convs = [m for m in tower.model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    assert any(isinstance(m, PatchMatmul) for m in tower.model.modules())
    assert not [m for m in convs if tuple(m.kernel_size) == tuple(m.stride)]
