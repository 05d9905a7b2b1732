"""The gateway's pixel budget must be the processor's, exactly."""

from __future__ import annotations

import pytest
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

from gateway.resize import smart_resize

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
