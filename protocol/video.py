"""Wire messages for videos: gateway → encoder, encoder → gateway, and the
references the engine is sent (GenerateRequest.videos). Frames and tokens travel as raw frames beside the header
(protocol/tensors.py), never pickled.

A video travels as the frames the gateway's loader kept (uint8 (T, H, W, 3),
one frame of the message per video) with the loader's metadata, which the
checkpoint's video processor and the time axis need (docs/video.md); its
tokens come back with their grid and time axis: Qwen2.5-VL's seconds per
temporal patch, Qwen3-VL's per-patch timestamps.
"""

from __future__ import annotations

import msgspec

from protocol.base import Message
from protocol.tensors import ArrayMeta
from protocol.timings import EncoderTimings


class LoaderMetadata(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """vLLM's video loader's metadata, key for key (VideoLoader.create_hf_metadata)."""

    fps: float  # the source's frame rate
    total_num_frames: int  # the source's frame count
    duration: float  # seconds
    frames_indices: list[int]  # the source frame each sent frame is
    do_sample_frames: bool  # every frame kept: the processor may sample (Qwen3-VL)
    video_backend: str = "opencv"

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__struct_fields__}


class VideoKnobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The request's video processor knobs (vLLM's mm_processor_kwargs); None: the checkpoint's default."""

    fps: float | None = None
    num_frames: int | None = None
    do_sample_frames: bool | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


class VideoInput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    # The gateway's digest: the source bytes and its loader's sampling; the encoder adds
    # its model, its video processor's defaults and `knobs` (cache/video_keys.py).
    digest: bytes
    metadata: LoaderMetadata
    knobs: VideoKnobs = VideoKnobs()
    # uint8 (T, H, W, 3), RGB, one frame of the message; None: "look it up only" (a miss is
    # answered EncodeNeedsPixels, as an image's)
    frames: ArrayMeta | None = None


class EncodeVideos(Message):
    """Gateway → encoder: a request's videos, in order of appearance."""

    request_id: str
    videos: list[VideoInput]
    push_to: str = ""  # as EncodeRequest.push_to: the engine the tokens are pushed to as they are encoded
    retry: bool = False  # as EncodeRequest.retry: its lookups were counted already
    priority: int = 0  # as EncodeRequest.priority


class EncodedVideo(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A video's visual tokens, by reference (the engine fetches them by `key`)."""

    embeddings: ArrayMeta  # (t·h·w / merge², width)
    grid_thw: tuple[int, int, int]
    cache_hit: bool
    key: bytes
    identity: bytes  # what `key` was hashed from: checked on every fetch
    second_per_grid_t: float | None = None  # Qwen2.5-VL: M-RoPE's time axis
    timestamps: list[float] | None = None  # Qwen3-VL: one per temporal patch, written into the prompt
    pushed: bool = False


class VideosEncodeResult(Message):
    """Encoder → gateway: the answer to EncodeVideos, one entry per video, in order."""

    request_id: str
    videos: list[EncodedVideo]
    timings: EncoderTimings


class VideoEmbedding(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One video's tokens as the engine takes them (llm_engine/videos.py): by reference, fetched
    from the encoder at `source` unless they were pushed (a GenerateRequest's `videos`)."""

    embeddings: ArrayMeta
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None
    timestamps: list[float] | None = None
    key: bytes = b""  # the video's multi_modal_uuids entry, and what it is fetched by
    source: str = ""
    identity: bytes = b""
    pushed: bool = False


def video_reference(video: EncodedVideo, source: str) -> VideoEmbedding:
    """An encoder's answer for one video as the engine takes it: fetched from `source` unless pushed."""
    return VideoEmbedding(video.embeddings, video.grid_thw, video.second_per_grid_t, video.timestamps, video.key, source,
                          video.identity, video.pushed)

