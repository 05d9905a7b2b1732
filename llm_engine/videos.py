"""Videos as vLLM 0.32 takes them precomputed: `multi_modal_data["video"]`
for Qwen's families (docs/video.md).

One dict holds every video of a prompt: `video_embeds` flat (Σ t·h·w / merge²
rows, all videos concatenated, as images), `video_grid_thw` (n, 3), and
what the positions need: Qwen2.5-VL's `second_per_grid_ts` (n,) and
Qwen3-VL's `timestamps` (one list per video, one value per temporal patch;
vLLM writes them into the prompt as "<t seconds>" before each patch's
tokens). The prompt holds one <|vision_start|><|video_pad|><|vision_end|> per
video (the chat template's video part); vLLM expands it from the grid.

Qwen2.5-VL's data parser declares only `video_embeds` and `video_grid_thw`
for embeddings, yet `second_per_grid_ts` still reaches the positions: the
dict passes through to the family's processor, whose field config has it
(tests/integration/test_video_parity.py shows a wrong value moves the answer).
Without it vLLM would take one second per temporal patch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

VIDEO_PLACEHOLDER_TEXT = "<|vision_start|><|video_pad|><|vision_end|>"


class InvalidVideo(ValueError):
    """The video embeddings cannot be served as sent (answered with HTTP 400)."""


@dataclass(frozen=True)
class VideoEmbeds:
    """One video's tokens from the encoder (vision_encoder/qwen_video.VideoTokens)."""

    tokens: torch.Tensor  # (t·h·w / merge², width)
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None  # Qwen2.5-VL
    timestamps: tuple[float, ...] | None = None  # Qwen3-VL


def embeds_of(video, tokens: torch.Tensor) -> VideoEmbeds:
    """A wire VideoEmbedding (protocol/video.py) and its fetched tensor."""
    timestamps = None if video.timestamps is None else tuple(video.timestamps)
    return VideoEmbeds(tokens, tuple(video.grid_thw), video.second_per_grid_t, timestamps)


# The longest clip: its time becomes rotary positions (Qwen2.5-VL: 2 a second), which must stay
# inside the model's position table (128k); the gateway holds clips to it (gateway.max_video_duration_s).
MAX_VIDEO_SECONDS = 36000.0


def check_video(video: VideoEmbeds, family: str, width: int, merge_size: int, index: int = 0) -> None:
    """What vLLM's front end lets through and its engine core then dies on, refused here."""
    t, h, w = video.grid_thw
    rows = t * h * w // merge_size**2
    if video.tokens.ndim != 2 or tuple(video.tokens.shape) != (rows, width):
        raise InvalidVideo(f"videos[{index}]: embeddings of shape {tuple(video.tokens.shape)}, expected ({rows}, {width}) "
                           f"for grid {video.grid_thw}")
    # Each becomes rotary positions in vLLM's engine core: past its position table, the core dies.
    if family == "Qwen2.5-VL" and not (video.second_per_grid_t and 0 < video.second_per_grid_t * t <= MAX_VIDEO_SECONDS):
        raise InvalidVideo(f"videos[{index}]: Qwen2.5-VL needs second_per_grid_t > 0, over at most {MAX_VIDEO_SECONDS:g} s "
                           f"in all, not {video.second_per_grid_t} s × {t}")
    if family == "Qwen3-VL" and (video.timestamps is None or len(video.timestamps) != t):
        raise InvalidVideo(f"videos[{index}]: Qwen3-VL needs one timestamp per temporal patch ({t})")
    if family == "Qwen3-VL" and not all(math.isfinite(stamp) and 0 <= stamp <= MAX_VIDEO_SECONDS for stamp in video.timestamps):
        raise InvalidVideo(f"videos[{index}]: Qwen3-VL's timestamps must lie in [0, {MAX_VIDEO_SECONDS:g}] s")


def video_data(videos: Sequence[VideoEmbeds], family: str) -> dict:
    """vLLM's `multi_modal_data["video"]` for a prompt's videos, in order."""
    data = {
        "video_embeds": torch.cat([v.tokens for v in videos]),
        "video_grid_thw": torch.tensor([v.grid_thw for v in videos], dtype=torch.int64),
    }
    if family == "Qwen2.5-VL":
        data["second_per_grid_ts"] = torch.tensor([v.second_per_grid_t for v in videos], dtype=torch.float32)
    if family == "Qwen3-VL":
        data["timestamps"] = [list(v.timestamps) for v in videos]
    return data
