"""Videos through a Qwen tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), as vLLM 0.32
turns a video into visual tokens (docs/video.md).

The gateway decodes and samples a clip the way vLLM's video loader does and
sends its frames with the loader's metadata (VideoClip). Here the
checkpoint's own video processor (`video_preprocessor_config.json`) resizes,
normalises and stacks frames in pairs (temporal patch 2; an odd count is
padded with its last frame), exactly as vLLM calls it per family; the same
packed forward as images then runs on the (t, h, w) grid, since Qwen's towers
attend within each temporal patch. Besides the tokens, what the language
model's positions need travels on: Qwen2.5-VL's `second_per_grid_t` (seconds
between temporal patches) and Qwen3-VL's `timestamps` (each temporal patch's
time, written into the prompt as "<t seconds>").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from transformers.image_utils import PILImageResampling

from cache import content_key
from cache.video_keys import video_key
from protocol.to_gateway import VideoSizing
from vision_encoder.towers.fused_patches import channels_first_view, fuse_normalize_into_patchify
from vision_encoder.towers.qwen_tower import Preprocessed, QwenTower, plan_of
from vision_encoder.towers.tower import local_checkpoint


@dataclass(frozen=True)
class VideoClip:
    """A sampled clip and the metadata vLLM's video loader yields with it
    (vllm/multimodal/video.py, VideoLoader.create_hf_metadata)."""

    frames: np.ndarray  # uint8 (T, H, W, 3), RGB: the frames the loader kept
    fps: float  # the source's frame rate
    total_num_frames: int  # the source's frame count
    duration: float  # seconds, total_num_frames / fps as the loader read them
    frames_indices: tuple[int, ...]  # the source frame each of `frames` is
    # True when the loader kept every frame: vLLM then lets the processor sample (Qwen3-VL)
    do_sample_frames: bool
    video_backend: str = "opencv"

    def __post_init__(self) -> None:
        # A wrong shape fails deep in the processor; a wrong index list gives wrong timestamps silently.
        f = self.frames
        if f.dtype != np.uint8 or f.ndim != 4 or f.shape[-1] != 3 or not f.shape[0]:
            raise ValueError(f"video frames: expected uint8 (T, H, W, 3) with T ≥ 1, got {f.dtype} {f.shape}")
        if len(self.frames_indices) != f.shape[0]:
            raise ValueError(f"video metadata: {len(self.frames_indices)} frames_indices for {f.shape[0]} frames")
        if not (self.fps > 0 and self.total_num_frames >= f.shape[0]):
            raise ValueError(f"video metadata: fps {self.fps} and total_num_frames {self.total_num_frames} "
                             f"for {f.shape[0]} frames")

    @classmethod
    def from_metadata(cls, frames: np.ndarray, metadata: dict) -> "VideoClip":
        """From the frames and the metadata dict vLLM's loader yields (the gateway's SampledVideo.hf_metadata())."""
        return cls(frames, float(metadata["fps"]), int(metadata["total_num_frames"]), float(metadata["duration"]),
                   tuple(int(i) for i in metadata["frames_indices"]), bool(metadata["do_sample_frames"]),
                   str(metadata.get("video_backend", "opencv")))

    def hf_metadata(self) -> Any:
        from transformers.video_utils import VideoMetadata

        return VideoMetadata(total_num_frames=self.total_num_frames, fps=self.fps, duration=self.duration,
                             video_backend=self.video_backend, frames_indices=list(self.frames_indices))


@dataclass(frozen=True)
class VideoSampling:
    """The request's video processor knobs, as vLLM's `mm_processor_kwargs` pass them
    to the checkpoint's video processor; None: the checkpoint's default
    (`video_preprocessor_config.json`). Qwen2/2.5-VL's processors sample frames only
    with `do_sample_frames`; Qwen3-VL's sample a clip the loader kept whole."""

    fps: float | None = None
    num_frames: int | None = None
    do_sample_frames: bool | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None

    @classmethod
    def from_knobs(cls, knobs: Any) -> "VideoSampling":
        """From the wire's VideoKnobs (protocol/video.py), field for field."""
        return cls(**{name: getattr(knobs, name) for name in knobs.__struct_fields__})

    def params(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class PreprocessedVideo:
    batch: Preprocessed  # one video: pixel values (Σ t·h·w patches, C·2·P·P) and its (1, 3) grid
    second_per_grid_t: float | None  # Qwen2.5-VL: seconds per temporal patch (M-RoPE's time axis)
    timestamps: tuple[float, ...] | None  # Qwen3-VL: each temporal patch's time in seconds (prompt text)


@dataclass(frozen=True)
class VideoTokens:
    """One video's visual tokens and what the engine needs beside them (llm_engine/videos.py)."""

    tokens: torch.Tensor  # (t·h·w / merge², hidden × (1 + DeepStack layers)), on the host
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None
    timestamps: tuple[float, ...] | None = None


def budget_size(size: Any, min_pixels: int | None = None, max_pixels: int | None = None) -> dict:
    """A video processor's `size` with a pixel budget's edges over it, as vLLM resolves
    min/max_pixels against the processor's defaults (Qwen2VLProcessingInfo._get_vision_size)."""
    edges = {k: v for k, v in dict(size).items() if v is not None}
    edges.update({k: v for k, v in (("shortest_edge", min_pixels), ("longest_edge", max_pixels)) if v})
    return edges


def video_sizing(processor: Any, family: str) -> VideoSizing | None:
    """The frame sizing the gateway may apply in `processor`'s place (the handshake's): only where
    its resize is the bicubic one the gateway runs, and where the frames it is handed are the frames
    it keeps (a processor that samples every clip itself sizes by its own frame count)."""
    p = processor
    qwen3 = family == "Qwen3-VL"  # whose processor samples only a clip the loader kept whole (QwenVideo._kwargs)
    if not p.do_resize or int(p.resample) != int(PILImageResampling.BICUBIC) or (p.do_sample_frames and not qwen3):
        return None
    return VideoSizing(p.patch_size, p.merge_size, p.temporal_patch_size, int(p.size["shortest_edge"]),
                       int(p.size["longest_edge"]), budget_over_frames=qwen3,
                       cap_pixels_per_frame=bool(p.cap_pixels_per_frame), max_video_tokens=int(p.max_video_tokens),
                       resamples_whole_clips=qwen3)


def calculate_timestamps(indices: list[int], video_fps: float, temporal_patch: int) -> list[float]:
    """Qwen3-VL: each temporal patch's time, the mean of its first and last frame's
    (Qwen3VLProcessingInfo._calculate_timestamps; an odd tail repeats its last frame)."""
    if len(indices) % temporal_patch:
        indices = indices + [indices[-1]] * (temporal_patch - len(indices) % temporal_patch)
    seconds = [i / video_fps for i in indices]
    return [(seconds[i] + seconds[i + temporal_patch - 1]) / 2 for i in range(0, len(seconds), temporal_patch)]


class QwenVideo:
    """The video path of a loaded QwenTower: its checkpoint's video processor, its ViT."""

    def __init__(self, tower: QwenTower) -> None:
        from transformers import AutoVideoProcessor

        self.tower = tower
        path = local_checkpoint(tower.model_id)
        self.processor = AutoVideoProcessor.from_pretrained(path)
        if tower.pixel_budget:
            # vLLM routes a processor-level min/max_pixels to the video processor as well as the
            # image processor (its kwargs scopes), over the video processor's own size defaults.
            # Both spellings: Qwen2-VL's reads a config's min/max_pixels over `size`.
            size = budget_size(self.processor.size, **tower.pixel_budget)
            self.processor = AutoVideoProcessor.from_pretrained(
                path, size=size, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        fuse_normalize_into_patchify(self.processor, tower.dtype)  # the same patches, fewer copies
        self.family = tower.family.name

    def preprocessing_params(self) -> dict:
        """Every video processor default that changes the pixels or the frames the ViT sees (cache keys)."""
        p = self.processor
        names = ("size", "resample", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
                 "do_convert_rgb", "patch_size", "temporal_patch_size", "merge_size", "do_sample_frames", "fps",
                 "min_frames", "max_frames", "num_frames", "cap_pixels_per_frame", "max_video_tokens")
        values = {name: getattr(p, name, None) for name in names}
        values["size"] = dict(values["size"]) if values["size"] is not None else None
        values["resample"] = int(values["resample"]) if values["resample"] is not None else None
        return {"class": type(p).__name__, "dtype": str(self.tower.dtype), **values}

    def sizing(self) -> VideoSizing | None:
        return video_sizing(self.processor, self.family)

    def fingerprint(self) -> str:
        """The encoder's handshake fingerprint with this video path: the tower's (its images' keys) and
        this processor's parameters (its videos' keys, and the frame sizing the gateway applies). A
        replica restarted with another video_preprocessor_config.json answers as another encoder."""
        return content_key(self.tower.fingerprint, self.preprocessing_params()).hex()

    def cache_key(self, digest: bytes, sampling: VideoSampling = VideoSampling(), metadata: Mapping | None = None) -> bytes:
        """The key of this clip's tokens: `digest` is the gateway's (source bytes + its loader's sampling),
        `metadata` the loader's for the frames sent (`LoaderMetadata.as_dict()`)."""
        return video_key(self.tower.key_fingerprint, self.preprocessing_params(), sampling.params(), digest, metadata or {})

    def _kwargs(self, clip: VideoClip, sampling: VideoSampling) -> dict:
        """The processor's arguments as vLLM passes them for this family (docs/video.md)."""
        kwargs = {k: v for k, v in sampling.params().items() if k not in ("min_pixels", "max_pixels")}
        if sampling.min_pixels or sampling.max_pixels:
            kwargs["size"] = budget_size(self.processor.size, sampling.min_pixels, sampling.max_pixels)
        if self.family == "Qwen3-VL":
            kwargs.setdefault("do_sample_frames", clip.do_sample_frames)
            if "num_frames" in kwargs and "fps" not in kwargs:
                kwargs["fps"] = None  # else the processor's default fps would clash with num_frames
        return kwargs

    def sampled_indices(self, clip: VideoClip, kwargs: dict) -> list[int]:
        """The source frames the processor keeps (Qwen3-VL's timestamps are theirs)."""
        if not kwargs.get("do_sample_frames"):
            return list(clip.frames_indices)
        picked = self.processor.sample_frames(clip.hf_metadata(), num_frames=kwargs.get("num_frames"), fps=kwargs.get("fps"))
        return [clip.frames_indices[int(i)] for i in picked]

    def preprocess(self, clip: VideoClip, sampling: VideoSampling = VideoSampling()) -> PreprocessedVideo:
        tower = self.tower
        kwargs = self._kwargs(clip, sampling)
        with tower.io.preparing():
            # vLLM hands Qwen2-VL's processor the frames alone (its parser drops the metadata)
            metadata = {} if self.family == "Qwen2-VL" else {"video_metadata": [clip.hf_metadata()]}
            out = self.processor(videos=[channels_first_view(clip.frames)], input_data_format="channels_first",
                                 return_tensors="pt", **metadata, **kwargs, **tower.processor_device)
            grid = out["video_grid_thw"].cpu()
            pixels = out["pixel_values_videos"].to(tower.dtype)
            ready = tower.io.prepared()
        second_per_grid_t, timestamps = self.time_axis(clip, sampling)
        return PreprocessedVideo(Preprocessed(pixels, grid, plan_of(tower.model, grid), ready), second_per_grid_t, timestamps)

    def time_axis(self, clip: VideoClip, sampling: VideoSampling = VideoSampling()) -> tuple[float | None, tuple[float, ...] | None]:
        """(Qwen2.5-VL's second_per_grid_t, Qwen3-VL's timestamps) for the clip: from its metadata
        alone, so a cache hit answers them without preprocessing a frame."""
        kwargs = self._kwargs(clip, sampling)
        temporal = self.processor.temporal_patch_size
        if self.family == "Qwen2.5-VL":
            return temporal / sampled_fps(clip, self.sampled_indices(clip, kwargs)), None
        if self.family == "Qwen3-VL":
            indices = self.sampled_indices(clip, kwargs)
            if len(indices) < temporal:  # the processor's refusal, before the clip joins a batch and fails it
                raise ValueError(f"{len(indices)} frame kept; Qwen3-VL needs at least {temporal} (its video processor's "
                                 "temporal_factor)")
            return None, tuple(calculate_timestamps(indices, clip.fps, temporal))
        return None, None

    def encode(self, video: PreprocessedVideo) -> VideoTokens:
        ((tokens, grid),) = self.tower.encode(video.batch)
        return VideoTokens(tokens, grid, video.second_per_grid_t, video.timestamps)

    def encode_clip(self, clip: VideoClip, sampling: VideoSampling = VideoSampling()) -> VideoTokens:
        return self.encode(self.preprocess(clip, sampling))


def video_path_of(tower: Any) -> QwenVideo:
    """The tower's video path; a family Prism does not encode videos for stops here, naming it."""
    if not isinstance(tower, QwenTower):
        raise ValueError(f"{tower.family.name} videos are not supported: Prism encodes videos for Qwen2-VL, "
                         "Qwen2.5-VL and Qwen3-VL")
    return QwenVideo(tower)


def sampled_fps(clip: VideoClip, indices: list[int]) -> float:
    """transformers' VideoMetadata.sampled_fps: the kept frames per second of source time."""
    return len(indices) / clip.total_num_frames * clip.fps


def join(tower: QwenTower, batches: list[Preprocessed]) -> Preprocessed:
    """Images' and videos' preprocessed inputs as one forward (batching by patch budget):
    the tower attends within each grid row's temporal patches, so each item's tokens are
    what it gets alone; `tower.encode` splits them back in this order. The join runs on the
    preprocessing stream (on a GPU), after each batch's work there: on the ViT's stream it
    would hold the batch still running there behind this one's preprocessing."""
    with tower.io.preparing():
        for batch in batches:
            tower.io.wait_for(batch.ready, [batch.pixel_values])
        grid = torch.cat([b.grid_thw for b in batches])
        pixels = torch.cat([b.pixel_values for b in batches])
        ready = tower.io.prepared()
    return Preprocessed(pixels, grid, plan_of(tower.model, grid), ready)
