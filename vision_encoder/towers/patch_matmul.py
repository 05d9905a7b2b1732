"""Patch embeddings as one matrix multiply, as vLLM runs them.

Every tower here starts with a convolution whose kernel equals its stride
(Qwen's Conv3d over 2×14×14 patches; CLIP's, SigLIP's and InternViT's Conv2d
over 14×14): each output is one patch times the weight matrix. transformers
runs it as a convolution, which on CPUs in bfloat16 has no fast kernel, so
it took a third of the tower's forward where the same product as a matmul is
a rounding error (docs/measurements/towers.md). vLLM's own towers
(`Conv2dLayer`, `Conv3dLayer` in vllm/model_executor/layers/conv.py) run this exact matmul
on CPUs, and on CUDA for Conv3d from torch 2.9 (where cuDNN's Conv3d
regressed); we follow the same rule, so the encoder computes what vLLM's
server does. vLLM's classes themselves cannot be used here: they are custom
ops that need vLLM's engine config set to be built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class PatchMatmul(nn.Module):
    """A non-overlapping convolution (kernel = stride, no padding, one group)
    as unfold + linear: vLLM's `_forward_mulmat`, for 2 or 3 spatial axes.
    Keeps the convolution's `weight` and `bias` (towers read their dtype)."""

    def __init__(self, conv: nn.Conv2d | nn.Conv3d) -> None:
        super().__init__()
        self.kernel_size = tuple(conv.kernel_size)
        self.out_channels = conv.out_channels
        self.input_size = conv.in_channels * math.prod(self.kernel_size)
        self.weight = conv.weight
        self.bias = conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axes = len(self.kernel_size)
        batch = x.shape[0]
        out_sizes = [size // k for size, k in zip(x.shape[2:], self.kernel_size)]
        for axis, k in enumerate(self.kernel_size, start=2):
            x = x.unfold(axis, k, k)
        # (B, C, *out, *kernel) → (B, *out, C, *kernel): one row per patch
        x = x.permute(0, *range(2, 2 + axes), 1, *range(2 + axes, 2 + 2 * axes)).reshape(-1, self.input_size)
        y = F.linear(x, self.weight.view(self.out_channels, self.input_size), self.bias)
        return y.view(batch, *out_sizes, self.out_channels).permute(0, axes + 1, *range(1, axes + 1))


def _takes_matmul(conv: nn.Module, device: torch.device) -> bool:
    if not isinstance(conv, (nn.Conv2d, nn.Conv3d)):
        return False
    unpadded = conv.padding == "valid" or (not isinstance(conv.padding, str) and not any(conv.padding))  # SigLIP says "valid"
    non_overlapping = tuple(conv.kernel_size) == tuple(conv.stride) and conv.groups == 1 and all(d == 1 for d in conv.dilation)
    if not (unpadded and non_overlapping):
        return False
    # torch.__version__ is a TorchVersion: it compares as a version, not as text
    return device.type == "cpu" or (isinstance(conv, nn.Conv3d) and torch.__version__ >= "2.9")


def patch_convs_as_matmul(model: nn.Module, device: torch.device) -> int:
    """Swap every non-overlapping convolution of `model` for `PatchMatmul`
    where vLLM would run it as one (see the module's docstring); how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _takes_matmul(child, device):
                setattr(parent, name, PatchMatmul(child))
                swapped += 1
    return swapped
