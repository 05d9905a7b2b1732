"""Test clips written with OpenCV (mp4v in mp4, as vLLM's loader reads them),
and vLLM's own video loader's view of them: the frames and metadata its server
hands the model (VideoMediaIO's default: at most 32 frames, opencv)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ClipSpec:
    frames: int
    fps: float
    width: int
    height: int
    num_frames: int = 32  # the loader's cap (vLLM's server default: 32)


# lengths, frame rates, sizes, portrait, one frame, an odd count, one longer than the loader's 32 frames
CLIPS = {
    "short": ClipSpec(8, 4.0, 160, 120),
    "odd": ClipSpec(7, 5.0, 128, 96),
    # vLLM's opencv loader reads no frame of a one-frame file (its seek to the end and back
    # loses it, docs/video.md): a one-frame video is a clip sampled down to one frame
    "one-frame": ClipSpec(5, 5.0, 112, 112, num_frames=1),
    "portrait": ClipSpec(10, 10.0, 96, 176),
    "long": ClipSpec(60, 24.0, 176, 144),
    "slow": ClipSpec(6, 1.0, 144, 112),
    "six-seconds": ClipSpec(30, 5.0, 128, 96),  # kept whole by the loader, long enough for every sampling knob to bite
}


def write_clip(path: Path, spec: ClipSpec, seed: int = 0) -> Path:
    """A square that moves right and changes colour over a noisy background."""
    import cv2

    rng = np.random.default_rng(seed)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), spec.fps, (spec.width, spec.height))
    base = rng.integers(0, 80, (spec.height, spec.width, 3), dtype=np.uint8)
    side = max(8, min(spec.width, spec.height) // 4)
    for i in range(spec.frames):
        frame = base.copy()
        x = int((spec.width - side) * i / max(spec.frames - 1, 1))
        frame[spec.height // 3: spec.height // 3 + side, x: x + side] = (40 + 200 * i // max(spec.frames, 1), 200, 255 - 20 * (i % 8))
        writer.write(frame)
    writer.release()
    return path


def vllm_loaded(data: bytes, num_frames: int = 32, **kwargs) -> tuple[np.ndarray, dict]:
    """vLLM 0.32's video loader on the bytes, as its server calls it (VideoMediaIO)."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    return VIDEO_LOADER_REGISTRY.load("opencv").load_bytes(data, num_frames=num_frames, **kwargs)


def clip_of(frames: np.ndarray, metadata: dict):
    from vision_encoder.qwen_video import VideoClip

    return VideoClip(frames, float(metadata["fps"]), int(metadata["total_num_frames"]), float(metadata["duration"]),
                     tuple(int(i) for i in metadata["frames_indices"]), bool(metadata["do_sample_frames"]),
                     metadata.get("video_backend", "opencv"))
