"""The encoder's videos (issue 46): each `EncodeVideos` entry becomes a job in
the same batcher as images, keyed by cache/video_keys.py, so a video rides a
batch by the patch budget beside images (one tower forward: qwen_video.join),
is cached and deduplicated in flight as an image is, and its tokens leave by
the same hand-off (vision_encoder/handoff.py). Only the time axis
(second_per_grid_t, timestamps) is a video's own: it comes from the clip's
metadata, so a cache hit answers it without preprocessing a frame. A video
sent without frames (a repeat the gateway has not decoded) is looked up only:
its key and time axis come from its digest and metadata alone, and a miss is
answered EncodeNeedsPixels, as an image's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protocol.tensors import to_numpy
from protocol.video import VideoInput
from vision_encoder.towers.qwen_video import QwenVideo, VideoClip, VideoSampling, join

TimeAxis = tuple[float | None, tuple[float, ...] | None]  # (second_per_grid_t, timestamps)


@dataclass(frozen=True)
class VideoJob:
    """A video's work as the batcher holds it (Job.image)."""

    path: QwenVideo
    clip: VideoClip
    sampling: VideoSampling

    def preprocess(self):
        return self.path.preprocess(self.clip, self.sampling).batch

    @property
    def nbytes(self) -> int:
        return self.clip.frames.nbytes


@dataclass(frozen=True)
class VideoItem:
    """One video of a request, checked: its job, full key, identity, time axis and patch estimate."""

    job: VideoJob | None  # None: sent without frames, to be looked up only
    key: bytes
    identity: bytes
    axis: TimeAxis
    patches: int


def video_item(path: QwenVideo, tower, video: VideoInput, frame, index: int) -> VideoItem:
    """ValueError (the request's 400) for frames or metadata no loader yields, or knobs the processor refuses.
    `frame` None: the video was sent to be looked up only (`job` None)."""
    try:
        pixels = header_only(video.metadata.frames_indices) if frame is None else to_numpy(video.frames, frame)
        if frame is not None and (pixels.ndim != 4 or pixels.shape[3] != 3 or 0 in pixels.shape):
            raise ValueError(f"expected (t, h, w, 3) frames, each of them at least 1, got {video.frames}")
        clip = VideoClip.from_metadata(pixels, video.metadata.as_dict())
        sampling = VideoSampling.from_knobs(video.knobs)
        axis = path.time_axis(clip, sampling)
    except (ValueError, IndexError, TypeError) as exc:
        raise ValueError(f"video {index}: {exc}") from None
    key = path.cache_key(video.digest, sampling, video.metadata.as_dict())
    if frame is None:
        return VideoItem(None, key, b"video" + key, axis, 0)
    frames, height, width = clip.frames.shape[:3]
    temporal = path.processor.temporal_patch_size
    # the batcher's budget: an estimate (the video processor's pixel budget may shrink frames more than images')
    patches = math.ceil(frames / temporal) * tower.num_patches(height, width)
    return VideoItem(VideoJob(path, clip, sampling), key, b"video" + key, axis, patches)


def header_only(frames_indices: list[int]) -> np.ndarray:
    """Zero-sized frames standing in for a clip sent without them: the key and the time axis read
    the metadata alone, and the clip's checks (one index per frame) still hold."""
    return np.empty((len(frames_indices), 0, 0, 3), dtype=np.uint8)


def is_video(job) -> bool:
    return isinstance(job.image, VideoJob)


def images_first(jobs: list) -> list:
    """A batch's jobs in the order of its one forward's outputs (`prepare`)."""
    return sorted(jobs, key=is_video)


def prepare(tower, jobs: list):
    """The batch's preprocessed input: its images as one, then each video's, joined into one forward.
    `jobs` ordered by `images_first`."""
    images = [job.image for job in jobs if not is_video(job)]
    videos = [job.image for job in jobs if is_video(job)]
    if not videos:
        return tower.preprocess(images)
    return join(tower, ([tower.preprocess(images)] if images else []) + [video.preprocess() for video in videos])
