"""Synthetic clips of the demo model's scenes: one shape turns another colour half-way.

A clip is a prism/scenes.py scene held still for a second or three; at the
middle frame one of its shapes takes a colour no shape in the scene had.
"What colour does the square turn?" is answered by the colour it ends in, so a
model that answers it saw the clip's later frames, in order. Clips are mp4
(OpenCV's MPEG-4 Part 2, as loadtest/clips.py writes them) and seeded, so
training, the held-out accuracy set and the tests regenerate the same ones.

`served_frames` is what vLLM's server (and the gateway, which mirrors it)
keeps of a clip for the demo model: its "qwen2_vl" loader at 2 frames per
second, at least 4, an even count. Training looks at exactly those frames.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np

from loadtest.clips import write_mp4
from loadtest.colours import COLOURS
from prism import scenes

TEMPLATES = ("What colour does the {shape} turn?", "What color does the {shape} turn?")
KIND = "turns"  # the question kind's name in training logs and bench/accuracy.py


@dataclass(frozen=True)
class TurningClip:
    before: scenes.Scene  # the first half's frames
    after: scenes.Scene  # the second half's: `shape` in `colour`
    shape: str  # the kind of shape that turns
    colour: str  # the colour it turns
    size: tuple[int, int]  # width, height (even, as the encoder wants)
    fps: float
    num_frames: int

    def frames(self) -> list[np.ndarray]:
        """Every frame, RGB uint8: the first half as `before`, the rest as `after`."""
        first, second = (np.asarray(s.render(*self.size)) for s in (self.before, self.after))
        return [first if i < self.num_frames // 2 else second for i in range(self.num_frames)]

    def mp4(self) -> bytes:
        return write_mp4((np.ascontiguousarray(f[:, :, ::-1]) for f in self.frames()), self.fps, self.size)  # BGR

    def reversed(self) -> "TurningClip":
        """The clip played backwards: the shape turns from its second colour back to its first."""
        first = next(s.colour for s in self.before.shapes if s.kind == self.shape)
        return dataclasses.replace(self, before=self.after, after=self.before, colour=first)

    def question(self, rng: random.Random) -> scenes.Question:
        return scenes.Question(KIND, rng.choice(TEMPLATES).format(shape=self.shape), self.colour)


def make_clip(rng: random.Random, min_side: int = 96, max_side: int = 256,
              seconds: tuple[float, float] = (1.5, 3.0), fps: tuple[int, int] = (4, 12)) -> TurningClip:
    """A scene of one to three shapes, one of which turns a colour the scene lacks."""
    before = scenes.make_scene(rng)
    turning = rng.choice(before.shapes)
    colour = rng.choice(sorted(set(COLOURS) - {s.colour for s in before.shapes}))
    rgb = tuple(max(0, min(255, c + rng.randint(-18, 18))) for c in COLOURS[colour])
    turned = dataclasses.replace(turning, colour=colour, rgb=rgb)
    after = dataclasses.replace(before, shapes=tuple(turned if s is turning else s for s in before.shapes))
    width, height = scenes.render_size(before, rng, min_side, max_side)
    rate = rng.randint(*fps)
    frames = max(4, round(rng.uniform(*seconds) * rate))
    return TurningClip(before, after, turning.kind, colour, (width - width % 2, height - height % 2), float(rate), frames)


def served_frames(mp4: bytes) -> np.ndarray:
    """The frames vLLM's server keeps of the clip for a Qwen2-VL checkpoint (uint8 (T, H, W, 3), RGB):
    its "qwen2_vl" loader with VideoMediaIO's defaults, which the gateway's intake mirrors."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    frames, _metadata = VIDEO_LOADER_REGISTRY.load("qwen2_vl").load_bytes(mp4, num_frames=32)
    return frames
