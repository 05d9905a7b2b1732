"""The video parity clips (loadtest/clips.py's synthetic scenes, small enough
for two cores) and vLLM's own video loader's view of them: the frames and
metadata its server hands the model (VideoMediaIO's default: opencv, at most
32 frames), which is what the gateway's intake yields (SampledVideo)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadtest.clips import ClipSpec, make_clip


@dataclass(frozen=True)
class ParityClip:
    spec: ClipSpec
    loader_frames: int = 32  # the loader's num_frames (vLLM's server default: 32)


# lengths, frame rates, sizes, portrait, an odd frame count, one the loader samples down, one frame
CLIPS = {
    "short": ParityClip(ClipSpec(160, 120, 4.0, 8, seed=1)),
    "odd": ParityClip(ClipSpec(128, 96, 5.0, 7, seed=2)),
    # vLLM's opencv loader reads no frame of a one-frame file (its probe seeks to the end
    # and back, and the frame is lost; docs/video.md): a one-frame video here is a clip
    # the loader samples down to one frame
    "one-frame": ParityClip(ClipSpec(112, 112, 5.0, 5, seed=3), loader_frames=1),
    "portrait": ParityClip(ClipSpec(96, 176, 10.0, 10, seed=4)),
    "long": ParityClip(ClipSpec(176, 144, 24.0, 60, seed=5)),  # the loader keeps 32 of 60
    "slow": ParityClip(ClipSpec(144, 112, 1.0, 6, seed=6)),
    "six-seconds": ParityClip(ClipSpec(128, 96, 5.0, 30, seed=7)),  # kept whole, long enough for every sampling knob to bite
}


def vllm_loaded(data: bytes, num_frames: int = 32, **kwargs) -> tuple[np.ndarray, dict]:
    """vLLM 0.32's video loader on the bytes, as its server calls it (VideoMediaIO)."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    return VIDEO_LOADER_REGISTRY.load("opencv").load_bytes(data, num_frames=num_frames, **kwargs)


def load_parity_clips() -> dict[str, tuple[np.ndarray, dict]]:
    return {name: vllm_loaded(make_clip(c.spec), c.loader_frames) for name, c in CLIPS.items()}
