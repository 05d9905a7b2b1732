"""The video side of a workload: which clips a load test sends, and how the
target is asked to sample them.

A clip is a synthetic scene from loadtest/clips.py (deterministic per seed),
of a length drawn from weighted named lengths ("short", "long", or any "<N>s");
with probability `repeat_ratio` a video request reuses one of the last
`pool_size` new clips, so a cache keyed by the clip's content sees repeats at
a known rate. The sampling (`sample_fps`: media_io_kwargs.video.fps) and the
pixel budget (`max_pixels`: mm_processor_kwargs) go with every video request,
spelled as vLLM's server takes them, so two servers sample alike.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.clips import ClipSpec, make_clip

# Named clip lengths in seconds; any other is spelled "<seconds>s" ("10s", "60s").
LENGTHS = {"short": 4.0, "long": 30.0}


@dataclass(frozen=True)
class VideoLength:
    name: str
    duration_s: float
    weight: float


@dataclass(frozen=True)
class VideoSpec:
    length: str  # the VideoLength's name
    width: int
    height: int
    fps: float  # the file's frame rate
    duration_s: float
    seed: int  # distinct clips have distinct seeds; a repeat is the same spec

    part = "video_url"  # the chat content part that carries it
    mime = "video/mp4"

    @property
    def path(self) -> str:
        return f"/{self.seed}.mp4"

    @property
    def clip(self) -> ClipSpec:
        return ClipSpec(self.width, self.height, self.fps, max(1, round(self.duration_s * self.fps)), self.seed)

    def render(self) -> bytes:
        return make_clip(self.clip)


@dataclass(frozen=True)
class VideoMix:
    lengths: tuple[VideoLength, ...]
    fraction: float = 0.5  # share of requests that carry one clip (and no image)
    repeat_ratio: float = 0.0  # share of video requests that resend a recent clip
    pool_size: int = 8  # how many recent new clips repeats draw from
    width: int = 320
    height: int = 240
    source_fps: float = 10.0
    sample_fps: float | None = None  # media_io_kwargs.video.fps; None: the model's default
    max_pixels: int | None = None  # mm_processor_kwargs.max_pixels; None: the model's default

    def __post_init__(self) -> None:
        if not self.lengths or any(v.weight < 0 or v.duration_s <= 0 for v in self.lengths) \
                or sum(v.weight for v in self.lengths) <= 0:
            raise ValueError("video lengths need positive durations and non-negative weights with a positive sum")
        if not 0 <= self.fraction <= 1 or not 0 <= self.repeat_ratio <= 1:
            raise ValueError("video fraction and video repeat ratio lie in [0, 1]")
        if self.pool_size < 1:
            raise ValueError("video pool size must be at least 1")
        ClipSpec(self.width, self.height, self.source_fps)  # its own checks on size and rate
        if self.sample_fps is not None and not self.sample_fps > 0:
            raise ValueError(f"video sample fps {self.sample_fps}: must be positive")


def parse_lengths(text: str) -> tuple[VideoLength, ...]:
    """"short=3,long=1,10s=1": names from LENGTHS or "<seconds>s", each with a weight."""
    lengths = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.partition("=")
        if name in LENGTHS:
            seconds = LENGTHS[name]
        else:
            try:
                seconds = float(name.removesuffix("s")) if name.endswith("s") else float("nan")
            except ValueError:
                seconds = float("nan")
            if not seconds > 0:
                raise ValueError(f"unknown video length {name!r}: use <seconds>s (e.g. 10s) or one of {', '.join(LENGTHS)}")
        lengths.append(VideoLength(name, seconds, float(weight or 1)))
    return tuple(lengths)


def pick_video(mix: VideoMix, rng: random.Random, recent: list[VideoSpec], salt: int = 0) -> tuple[VideoSpec, bool]:
    """The next video request's clip and whether it repeats one; `recent` is the pool, updated."""
    if recent and rng.random() < mix.repeat_ratio:
        return rng.choice(recent), True
    length = rng.choices(mix.lengths, [v.weight for v in mix.lengths])[0]
    video = VideoSpec(length.name, mix.width, mix.height, mix.source_fps, length.duration_s, rng.getrandbits(48) ^ salt)
    recent.append(video)
    del recent[: -mix.pool_size]
    return video, False
