"""Qwen's image and video processors, fed and run with fewer copies.

Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's processors (transformers' torchvision
backend) copy (h, w, 3) uint8 frames into (3, h, w) tensors, resize them,
turn them into float32, normalize them, then rearrange them into patches: a
permuted copy of four bytes per value, repeated along the temporal axis for
an image, with poor locality; then the tower casts the result to its dtype.
That copy work, not the arithmetic, is most of their time on a CPU. Here:

- the frames go in as a (3, h, w) view of their (h, w, 3) memory
  (`channels_first_view`, with `input_data_format="channels_first"`): no
  copy, and torch's resize takes its vectorised channels-last uint8 path,
  with the same pixels (as the gateway's `resize_pixels`);
- `fuse_normalize_into_patchify`: the processor rearranges the uint8 frames
  first (a quarter of the bytes) and normalizes the patches after, straight
  into the tower's dtype; an image is normalized before its temporal copy.
  Normalizing is per value with a per-channel constant, so the order of the
  two steps changes no bit.

`tests/unit/test_fused_patches.py` checks the output `torch.equal` to the
unchanged processor's on the (h, w, 3) arrays, cast alike.

Everything else stays the processor's own: sampling, resizing, its
`_preprocess` loop. The two methods it calls between them,
`rescale_and_normalize` and `patchify`, are replaced on the instance:
the first hands uint8 frames on untouched and leaves its arguments for the
second (per thread: one processor serves every preprocessing thread).
Anything but uint8 frames with both rescale and normalize on takes the
processor's own path.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import numpy as np
import torch

_IMAGE_DIMS = 4  # (batch, channels, height, width); a video's frames are (batch, frames, channels, height, width)


def channels_first_view(pixels: np.ndarray) -> torch.Tensor:
    """uint8 (..., h, w, 3) pixels as the (..., 3, h, w) tensor a processor takes, sharing their memory."""
    return torch.from_numpy(pixels).movedim(-1, -3)


def fuse_normalize_into_patchify(processor: Any, dtype: torch.dtype) -> Any:
    """`processor`, changed in place, its patches made in `dtype`; returned."""
    own_normalize, own_patchify = processor.rescale_and_normalize, processor.patchify
    deferred = threading.local()

    def rescale_and_normalize(self, images, do_rescale, rescale_factor, do_normalize, image_mean, image_std):
        if images.dtype != torch.uint8 or not (do_rescale and do_normalize):
            deferred.scale = None
            return own_normalize(images, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
        # The processor's own constants: mean and std over the rescale factor, in float32
        mean, std, _ = self._fuse_mean_std_and_rescale_factor(
            do_normalize=True, image_mean=image_mean, image_std=image_std, do_rescale=True,
            rescale_factor=rescale_factor, device=images.device,
        )
        deferred.scale = (mean, std)
        return images

    def patchify(self, images, patch_size, merge_size, temporal_patch_size):
        scale, deferred.scale = getattr(deferred, "scale", None), None
        if scale is None:
            patches, *grid = own_patchify(images, patch_size=patch_size, merge_size=merge_size,
                                          temporal_patch_size=temporal_patch_size)
            return (patches.to(dtype), *grid)
        image = images.dim() == _IMAGE_DIMS
        # An image's patch repeats it along time: normalize one copy, repeat after
        patches, *grid = own_patchify(images, patch_size=patch_size, merge_size=merge_size,
                                      temporal_patch_size=1 if image else temporal_patch_size)
        mean, std = scale
        channels = mean.numel()
        values = patches.to(torch.float32).unflatten(-1, (channels, -1))  # (..., channel, time·patch·patch)
        values.sub_(mean[:, None]).div_(std[:, None])  # as torchvision's normalize: subtract, then divide
        values = values.to(dtype)
        if image:  # (cat copies in long runs; an expanded view's reshape would copy 2 × patch values at a time)
            values = torch.cat([values.unsqueeze(-2)] * temporal_patch_size, dim=-2)
        return (values.flatten(patches.dim() - 1), *grid)  # back to (..., patch values)

    processor.rescale_and_normalize = types.MethodType(rescale_and_normalize, processor)
    processor.patchify = types.MethodType(patchify, processor)
    return processor
