"""The pixel budget: where an image of a given size ends up before the ViT.

`smart_resize` is Qwen2-VL's rule (transformers'
`models/qwen2_vl/image_processing_qwen2_vl.smart_resize`), restated here so
the gateway can downscale without importing torch: both sides a multiple of
`factor` (patch × merge), area within [min_pixels, max_pixels], aspect kept.
A unit test pins it to the transformers function.
"""

from __future__ import annotations

import math


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
