"""The size the encoder's video processor gives a clip's frames, and its tokens.

The encoder's handshake carries its video processor's sizing (`VideoSizing`).
With it the gateway resizes each kept frame as it is decoded, straight to the
size the processor would resize it to, with the processor's own resize
(gateway/intake/resize.py): the processor then finds nothing to resize, so its
output is the same, while the gateway holds and sends frames of that size
instead of the source's (a 1080p frame is 6 MB). The token count is known
before the decode too.

`processor_frame_size` restates transformers' `Qwen2VLVideoProcessor.resize`
(a per-frame budget) and `Qwen3VLVideoProcessor.resize` (a budget over the
clip's T × H × W), each with its `cap_pixels_per_frame` share;
tests/unit/test_video_sizing.py pins them to the processors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.intake.resize import smart_resize
from protocol.to_gateway import VideoSizing
from protocol.video import VideoKnobs


@dataclass(frozen=True)
class FramePlan:
    size: tuple[int, int] | None  # (height, width) to resize each kept frame to; None: keep them as decoded
    visual_tokens: int  # what the clip becomes in the encoder


def plan_frames(sizing: VideoSizing | None, knobs: VideoKnobs, frames: int, every_frame_kept: bool,
                height: int, width: int) -> FramePlan | None:
    """How `frames` kept frames of height × width are sent, and their tokens; None where the
    gateway cannot know (no sizing, or a processor that samples this clip again itself)."""
    if sizing is None or (every_frame_kept and sizing.resamples_whole_clips):
        return None
    min_pixels = knobs.min_pixels or sizing.min_pixels  # vLLM's budget_size: the request's edges over the processor's
    max_pixels = knobs.max_pixels or sizing.max_pixels
    try:
        target = processor_frame_size(sizing, frames, height, width, min_pixels, max_pixels)
        again = processor_frame_size(sizing, frames, *target, min_pixels, max_pixels)
    except ValueError:  # the processor refuses it too; the encoder's answer says why
        return None
    patches = (target[0] // sizing.patch_size) * (target[1] // sizing.patch_size)
    tokens = math.ceil(frames / sizing.temporal_patch_size) * patches // sizing.merge_size**2
    # Resized only where it shrinks the frames, and where the processor leaves the result alone:
    # a size its sizing would change again (an edge case of its rounding) would be resized twice.
    shrinks = target[0] * target[1] < height * width and again == target
    return FramePlan(target if shrinks else None, tokens)


def processor_frame_size(sizing: VideoSizing, frames: int, height: int, width: int, min_pixels: int,
                         max_pixels: int) -> tuple[int, int]:
    factor = sizing.patch_size * sizing.merge_size
    temporal = sizing.temporal_patch_size
    if not sizing.budget_over_frames:  # Qwen2VLVideoProcessor.resize
        if sizing.cap_pixels_per_frame:
            total_pixels = int(sizing.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * temporal // frames), int(min_pixels * 1.05))
        return smart_resize(height, width, factor, min_pixels, max_pixels)
    if sizing.cap_pixels_per_frame:  # Qwen3VLVideoProcessor.resize
        frame_cap = sizing.max_video_tokens * factor * factor
        max_pixels = max(min(frame_cap, max_pixels // frames), int(min_pixels * 1.05)) * frames
    return clip_smart_resize(frames, height, width, temporal, factor, min_pixels, max_pixels)


def clip_smart_resize(frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """transformers' models/qwen3_vl/video_processing_qwen3_vl.smart_resize."""
    if frames < temporal_factor:
        raise ValueError(f"t:{frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
