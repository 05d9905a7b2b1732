"""Synthetic video clips: coloured shapes moving over a gradient, as mp4 bytes.

Deterministic per seed (the same arguments give the same bytes), so tests,
parity checks and benchmarks can name a clip instead of storing one. A clip
is written with OpenCV's VideoWriter (MPEG-4 Part 2 in an mp4 container), the
same library vLLM's default video loader reads with.

The scene is chosen so a model can be asked about it: one shape moves left to
right across the clip, another changes colour half-way, a third stays put.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import cv2
import numpy as np

from loadtest.colours import COLOURS as RGB_COLOURS  # the demo model's colour names

# BGR, as OpenCV draws; names are what a question about the clip would use.
COLOURS = {name: (b, g, r) for name, (r, g, b) in RGB_COLOURS.items()}


@dataclass(frozen=True)
class ClipSpec:
    """What a clip shows and how it is encoded."""

    width: int = 320
    height: int = 240
    fps: float = 10.0
    num_frames: int = 20
    seed: int = 0

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps

    def __post_init__(self) -> None:
        if self.width < 16 or self.height < 16:
            raise ValueError(f"clip size {self.width}x{self.height}: both sides must be at least 16")
        if self.num_frames < 1:
            raise ValueError(f"num_frames {self.num_frames}: a clip has at least one frame")
        if not self.fps > 0:
            raise ValueError(f"fps {self.fps}: must be positive")


@dataclass(frozen=True)
class _Scene:
    background: np.ndarray  # (H, W, 3) uint8, BGR
    mover_colour: tuple[int, int, int]
    changer_colours: tuple[tuple[int, int, int], tuple[int, int, int]]
    still_colour: tuple[int, int, int]
    radius: int
    lane_y: tuple[int, int, int]


def _scene(spec: ClipSpec) -> _Scene:
    rng = np.random.default_rng(spec.seed)
    w, h = spec.width, spec.height
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x / w, y / h, (x + y) / (w + h)], axis=-1) * rng.uniform(40, 120, 3)
    names = list(COLOURS)
    picks = rng.permutation(len(names))[:4]
    colours = [COLOURS[names[i]] for i in picks]
    lanes = sorted(int(v) for v in rng.uniform(0.2, 0.8, 3) * h)
    return _Scene(
        background=base.astype(np.uint8),
        mover_colour=colours[0],
        changer_colours=(colours[1], colours[2]),
        still_colour=colours[3],
        radius=max(3, min(w, h) // 10),
        lane_y=(lanes[0], lanes[1], lanes[2]),
    )


def render_frame(spec: ClipSpec, scene: _Scene, index: int) -> np.ndarray:
    """Frame `index` of the clip, BGR uint8 (H, W, 3)."""
    frame = scene.background.copy()
    progress = index / max(spec.num_frames - 1, 1)
    r = scene.radius
    mover_x = int(r + progress * (spec.width - 2 * r))
    cv2.circle(frame, (mover_x, scene.lane_y[0]), r, scene.mover_colour, thickness=-1)
    changer = scene.changer_colours[0] if progress < 0.5 else scene.changer_colours[1]
    cx = spec.width // 2
    cv2.rectangle(frame, (cx - r, scene.lane_y[1] - r), (cx + r, scene.lane_y[1] + r), changer, thickness=-1)
    sx = spec.width - 2 * r
    triangle = np.array([[sx, scene.lane_y[2] - r], [sx - r, scene.lane_y[2] + r], [sx + r, scene.lane_y[2] + r]])
    cv2.fillPoly(frame, [triangle.astype(np.int32)], scene.still_colour)
    return frame


def make_clip(spec: ClipSpec) -> bytes:
    """The clip encoded as mp4 (mpeg4 video, no audio)."""
    scene = _scene(spec)
    return write_mp4((render_frame(spec, scene, index) for index in range(spec.num_frames)), spec.fps,
                     (spec.width, spec.height))


def write_mp4(frames_bgr: Iterable[np.ndarray], fps: float, size: tuple[int, int]) -> bytes:
    """BGR uint8 frames of `size` (width, height) as mp4 bytes (OpenCV's MPEG-4 Part 2, "mp4v")."""
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
        if not writer.isOpened():
            raise RuntimeError(f"OpenCV could not open an mp4 writer for {size[0]}×{size[1]} at {fps} fps")
        try:
            for frame in frames_bgr:
                writer.write(frame)
        finally:
            writer.release()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def clip(width: int = 320, height: int = 240, fps: float = 10.0, duration_s: float | None = None,
         num_frames: int | None = None, seed: int = 0) -> bytes:
    """A clip by size, rate and either a duration or a frame count."""
    if num_frames is None:
        num_frames = max(1, round((duration_s if duration_s is not None else 2.0) * fps))
    return make_clip(ClipSpec(width=width, height=height, fps=fps, num_frames=num_frames, seed=seed))


# Named clips the tests and benchmarks share: lengths, rates, sizes, portrait,
# one frame and an odd frame count.
NAMED = {
    "short": ClipSpec(320, 240, 10.0, 20, seed=1),
    "long": ClipSpec(320, 240, 10.0, 120, seed=2),
    "fps30": ClipSpec(256, 192, 30.0, 45, seed=3),
    "fps2": ClipSpec(256, 192, 2.0, 9, seed=4),
    "hd": ClipSpec(1280, 720, 10.0, 20, seed=5),
    "portrait": ClipSpec(180, 320, 12.0, 24, seed=6),
    "one-frame": ClipSpec(224, 224, 10.0, 1, seed=7),
    "odd-count": ClipSpec(200, 150, 7.0, 13, seed=8),
}


def named_clip(name: str) -> bytes:
    return make_clip(NAMED[name])
