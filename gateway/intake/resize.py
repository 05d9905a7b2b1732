"""The pixel budget: where an image of a given size ends up before the ViT,
and the resize that takes it there.

`smart_resize` is Qwen2-VL's rule (transformers'
`models/qwen2_vl/image_processing_qwen2_vl.smart_resize`), restated here so
the gateway sizes images without loading a processor: both sides a multiple
of `factor` (patch × merge), area within [min_pixels, max_pixels], aspect
kept. A unit test pins it to the transformers function.

`resize_pixels` is the resize transformers' image processors run (their
torchvision backend, which vLLM's processor uses too): bicubic, antialiased,
on uint8. A unit test pins it to the processor's own output.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_pixels(image: Image.Image | np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 (height, width, 3) pixels of an RGB image (or its (h, w, 3) array), as `tvF.resize(...,
    BICUBIC, antialias=True)` makes them: torchvision calls exactly this
    `interpolate` for uint8 on a CPU. On a channels-last view (the decoded
    (h, w, 3) array, no copy) it takes torch's vectorised uint8 path, several
    times faster than Pillow's resize (docs/measurements/intake.md), with
    the same pixels as the channels-first layout the processors use."""
    pixels = torch.from_numpy(np.asarray(image)).permute(2, 0, 1).unsqueeze(0)  # a view: (1, 3, h, w), channels last
    resized = torch.nn.functional.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return resized[0].permute(1, 2, 0).contiguous().numpy()
