"""Which frames of a video are kept: vLLM 0.32's raw-video path, index for index.

vLLM's server picks its video loader by the checkpoint's video processor class
(vllm/multimodal/video.py, `VIDEO_LOADER_REGISTRY`): `Qwen2VLVideoProcessor`
(Qwen2-VL, Qwen2.5-VL) → "qwen2_vl", `Qwen3VLVideoProcessor` → "qwen3_vl",
anything else → "opencv" (uniform). The loader's arguments are the request's
`media_io_kwargs["video"]` over `VideoMediaIO`'s `num_frames=32` and the
loader's own defaults (fps 2, min_frames 4, max_frames 768): not the
checkpoint's video_preprocessor_config.json, whose fps vLLM's loader never
reads. The functions below are those loaders' `compute_frames_index_to_sample`
written again (the gateway does not import vLLM); tests/unit/test_video_intake.py
checks them against vLLM's own on many clips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch

LoaderKind = Literal["qwen2_vl", "qwen3_vl", "opencv"]

# vLLM's names for each processor class (VIDEO_LOADER_REGISTRY.register(..., video_processor=...)).
LOADER_OF_PROCESSOR: dict[str, LoaderKind] = {
    "Qwen2VLVideoProcessor": "qwen2_vl",
    "Qwen3VLVideoProcessor": "qwen3_vl",
}
# The loaders' caps (Qwen2VLVideoBackend / Qwen3VLVideoBackend `_MAX_FRAMES`, `_MAX_FPS`).
QWEN_MAX_FRAMES = 768
QWEN_MAX_FPS = 30
MEDIA_IO_NUM_FRAMES = 32  # VideoMediaIO's default, which the uniform loader honours
LOADER_FPS = {"qwen2_vl": 2.0, "qwen3_vl": 2.0, "opencv": -1.0}
QWEN3_UNKNOWN_FPS = 24.0  # what Qwen3VLVideoBackend assumes for a source that reports none


def loader_for(video_processor_class: str | None) -> LoaderKind:
    return LOADER_OF_PROCESSOR.get(video_processor_class or "", "opencv")


@dataclass(frozen=True)
class VideoSampling:
    """The loader and its arguments: what decides which frames are kept (part of the cache key).

    None means "the loader's default", exactly as an absent media_io_kwargs key."""

    loader: LoaderKind = "qwen2_vl"
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None

    @property
    def target_fps(self) -> float:
        return LOADER_FPS[self.loader] if self.fps is None else float(self.fps)

    @property
    def target_num_frames(self) -> int:
        return MEDIA_IO_NUM_FRAMES if self.num_frames is None else self.num_frames

    def key_part(self) -> dict:
        return {"loader": self.loader, "fps": self.fps, "num_frames": self.num_frames,
                "min_frames": self.min_frames, "max_frames": self.max_frames}


@dataclass(frozen=True)
class SourceInfo:
    """What the container says, before any frame is decoded (vLLM's VideoSourceMetadata)."""

    total_frames: int
    fps: float
    duration_s: float
    width: int
    height: int
    codec: str = ""  # the stream's FourCC as OpenCV reads it ("avc1", "FMP4"); "" where unknown
    # The frames the stream holds from its start, where a decode found fewer than the header
    # counts (None: as counted): its last frame (a count one over the stream passes vLLM's check),
    # or a tail of a Matroska clip whose count is an estimate. vLLM's loader then reads every kept
    # frame below it.
    readable_frames: int | None = None


@dataclass(frozen=True, eq=False)
class SampledVideo:
    """The frames vLLM's loader would hand its processor, and the metadata beside them.

    `hf_metadata()` is the loader's metadata dict, key for key, for the HF video
    processor (`video_metadata`); `sampling` and `digest` make the cache key."""

    frames: np.ndarray  # uint8 (T, H, W, 3), RGB, C-contiguous
    source_fps: float  # the container's fps (Qwen3: 24 where it reports none)
    total_frames: int  # the container's frame count (edit-list corrected, as vLLM does)
    duration_s: float  # total_frames / source_fps (0 if no fps)
    frame_indices: tuple[int, ...]  # the source frames kept, in order
    sampling: VideoSampling
    loader_backend: str = "opencv"  # vLLM's "video_backend" metadata value
    digest: bytes = field(default=b"", repr=False)  # the video's part of the cache key (gateway/intake/video/intake.py)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sample: how far apart the kept frames are on average."""
        if self.num_frames < 2 or self.source_fps <= 0:
            return self.sampling.target_fps
        span = (self.frame_indices[-1] - self.frame_indices[0]) / self.source_fps
        return (self.num_frames - 1) / span if span > 0 else self.sampling.target_fps

    @property
    def nbytes(self) -> int:
        return self.frames.nbytes

    def hf_metadata(self) -> dict:
        return loader_metadata(self.source_fps, self.total_frames, self.duration_s, self.frame_indices, self.loader_backend)


def loader_metadata(fps: float, total_frames: int, duration_s: float, frame_indices, backend: str = "opencv") -> dict:
    """vLLM's loader's metadata dict for the kept frames, key for key (a decoded video's, or an
    inspected one's before its decode: the same)."""
    return {
        "total_num_frames": total_frames,
        "fps": fps,
        "duration": duration_s,
        "video_backend": backend,
        "frames_indices": list(frame_indices),
        # vLLM's create_hf_metadata: True only when every frame was kept.
        "do_sample_frames": len(frame_indices) == total_frames,
    }


def prepared_source(source: SourceInfo, loader: LoaderKind) -> SourceInfo:
    """The loader's `_prepare_source`: Qwen3-VL assumes 24 fps where none is reported."""
    if loader == "qwen3_vl" and source.fps <= 0:
        return replace(source, fps=QWEN3_UNKNOWN_FPS)
    return source


def frame_indices(source: SourceInfo, sampling: VideoSampling) -> list[int]:
    """The source frames vLLM's loader keeps (`source` already prepared)."""
    if sampling.loader == "qwen2_vl":
        return _qwen2_vl(source, sampling)
    if sampling.loader == "qwen3_vl":
        return _qwen3_vl(source, sampling)
    return _uniform(source, sampling)


def _uniform(source: SourceInfo, sampling: VideoSampling) -> list[int]:
    # VideoBackend.compute_frames_index_to_sample
    total, num_frames, fps = source.total_frames, sampling.target_num_frames, sampling.target_fps
    keep = total
    if num_frames > 0:
        keep = min(num_frames, total)
    if fps > 0:
        keep = min(keep, math.floor(source.duration_s * fps))
    keep = max(1, keep)
    if keep == total:
        return list(range(keep))
    return np.linspace(0, total - 1, keep, dtype=int).tolist()


class NoFramesKept(ValueError):
    """Sampling keeps no frame (where transformers' own sampling divides by zero)."""


def _qwen2_vl(source: SourceInfo, sampling: VideoSampling, temporal_patch_size: int = 2) -> list[int]:
    # Qwen2VLVideoBackend.compute_frames_index_to_sample (transformers' sample_frames, fps mode)
    total = source.total_frames
    min_frames = 4 if sampling.min_frames is None else sampling.min_frames
    max_frames = min(QWEN_MAX_FRAMES if sampling.max_frames is None else sampling.max_frames, QWEN_MAX_FRAMES)
    max_frames = math.floor(min(max_frames, total) / temporal_patch_size) * temporal_patch_size
    n = total / source.fps * min(sampling.target_fps, QWEN_MAX_FPS)
    n = min(max(n, min_frames), max_frames, total)
    n = math.floor(n / temporal_patch_size) * temporal_patch_size
    if n == 0:  # max_frames of 1, or min_frames of 1 at a low fps: fewer frames than one temporal patch
        raise NoFramesKept(f"sampling keeps fewer frames than one temporal patch ({temporal_patch_size})")
    # torch's float32 arange is the one transformers uses; numpy's float64 differs by a frame on some inputs.
    indices = torch.arange(0, total, total / n).int()
    return torch.clamp(indices, max=total - 1).tolist()


def _qwen3_vl(source: SourceInfo, sampling: VideoSampling) -> list[int]:
    # Qwen3VLVideoBackend.compute_frames_index_to_sample
    total = source.total_frames
    fps = min(sampling.target_fps, QWEN_MAX_FPS)
    min_frames = 4 if sampling.min_frames is None else sampling.min_frames
    max_frames = min(QWEN_MAX_FRAMES if sampling.max_frames is None else sampling.max_frames, QWEN_MAX_FRAMES)
    n = int(total / source.fps * fps)
    n = min(max(n, min_frames), max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()
