"""Synthetic scenes for the trained demo model: shapes, colours, questions, answers.

A scene is one to three shapes of distinct kinds in distinct named colours on a
plain or textured neutral background. It is described in coordinates relative
to the image, so one scene renders at any resolution (256² and 4K show the
same picture). Everything is drawn from a seed, so training, the held-out
accuracy set and the tests all regenerate the same scenes.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from loadtest.colours import COLOURS

SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = ("zero", "one", "two", "three")
BACKGROUNDS = ("plain", "noise", "stripes", "checks")
SQUARE_HALF = 0.9  # a square's half side, in units of its radius: it looks as big as the circle
TRIANGLE_BASE = 0.8  # the base sits this far below the centre, the apex one radius above

# Question kinds and their templates; the answer rule lives in `answer`.
TEMPLATES = {
    "colour": ("What colour is the {shape}?", "What color is the {shape}?"),
    "shape": ("What shape is the {colour} one?", "Which shape is {colour}?"),
    "count": ("How many shapes are there?", "How many shapes are in the image?"),
    "describe": ("Describe the image.", "What is in the image?"),
    # Asked of one-shape scenes only, and only in the last training phase; the
    # answer is compact JSON, as a structured-output backend without
    # whitespace writes it.
    "json": ("Describe the shape in JSON.", "Answer in JSON: which shape is it, and what colour?"),
}
KINDS = ("colour", "shape", "count", "describe")  # the plain kinds, asked of any scene
# What a "json" answer holds, as a `response_format` schema; keys in the trained order.
JSON_SCHEMA = {
    "type": "object",
    "properties": {"shape": {"enum": list(SHAPES)}, "colour": {"enum": list(COLOURS)}},
    "required": ["shape", "colour"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    rgb: tuple[int, int, int]
    cx: float  # centre, as fractions of width and height
    cy: float
    size: float  # bounding-box side, as a fraction of the shorter image side

    def in_pixels(self, width: int, height: int) -> tuple[float, float, float]:
        """Centre and radius in pixels, for a scene drawn at width × height."""
        return self.cx * width, self.cy * height, self.size * min(width, height) / 2

    @property
    def shape_class(self) -> int:
        return 1 + SHAPES.index(self.kind)  # 0 is background, for the training probes

    @property
    def colour_class(self) -> int:
        return 1 + list(COLOURS).index(self.colour)


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]
    background: str
    tones: tuple[tuple[int, int, int], tuple[int, int, int]]  # two neutral tones
    period: float  # texture period, as a fraction of the shorter side
    noise_seed: int
    aspect: float  # width / height the scene was composed for

    def render(self, width: int, height: int) -> Image.Image:
        image = Image.fromarray(_background(self, width, height))
        draw = ImageDraw.Draw(image)
        for shape in self.shapes:
            _draw(draw, shape, *shape.in_pixels(width, height))
        return image

    def covering(self, x: np.ndarray, y: np.ndarray, width: int, height: int) -> np.ndarray:
        """Per pixel position: 1 + the index of the shape drawn there, 0 for background."""
        found = np.zeros(np.broadcast(x, y).shape, dtype=np.int64)
        for index, shape in enumerate(self.shapes, start=1):
            cx, cy, r = shape.in_pixels(width, height)
            found = np.where(_inside(shape.kind, x - cx, y - cy, r) & (found == 0), index, found)
        return found

    def describe(self) -> str:
        parts = [f"{_article(s.colour)} {s.colour} {s.kind}" for s in sorted(self.shapes, key=lambda s: s.cx)]
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _neutral(rng: random.Random) -> tuple[int, int, int]:
    level = rng.randint(20, 235)
    return tuple(max(0, min(255, level + rng.randint(-8, 8))) for _ in range(3))


def make_scene(rng: random.Random, count: int | None = None, aspect: float | None = None) -> Scene:
    count = count or rng.randint(1, 3)
    aspect = aspect or math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
    kinds = rng.sample(SHAPES, count)
    colours = rng.sample(sorted(COLOURS), count)
    placed: list[Shape] = []
    while len(placed) < count:
        size = rng.uniform(0.22, 0.36) if count > 1 else rng.uniform(0.25, 0.6)
        # Keep the whole shape inside the frame, in relative units per axis.
        half_w, half_h = size / 2 * min(1, 1 / aspect), size / 2 * min(1, aspect)
        cx, cy = rng.uniform(half_w, 1 - half_w), rng.uniform(half_h, 1 - half_h)
        if all(_apart(cx, cy, size, other, aspect) for other in placed):
            base = COLOURS[colours[len(placed)]]
            rgb = tuple(max(0, min(255, c + rng.randint(-18, 18))) for c in base)
            placed.append(Shape(kinds[len(placed)], colours[len(placed)], rgb, cx, cy, size))
    tones = (_neutral(rng), _neutral(rng))
    return Scene(tuple(placed), rng.choice(BACKGROUNDS), tones, rng.uniform(0.05, 0.2), rng.randrange(2**31), aspect)


def _apart(cx: float, cy: float, size: float, other: Shape, aspect: float) -> bool:
    # Distance in units of the shorter side; shapes must not touch.
    scale_x, scale_y = max(aspect, 1), max(1 / aspect, 1)
    distance = math.hypot((cx - other.cx) * scale_x, (cy - other.cy) * scale_y)
    return distance > (size + other.size) / 2 * 1.15


def ask(scene: Scene, rng: random.Random, kind: str | None = None) -> Question:
    kind = kind or rng.choice(KINDS)
    template = rng.choice(TEMPLATES[kind])
    target = rng.choice(scene.shapes)
    text = template.format(shape=target.kind, colour=target.colour)
    return Question(kind, text, answer(scene, kind, target))


def answer(scene: Scene, kind: str, target: Shape) -> str:
    if kind == "colour":
        return target.colour
    if kind == "shape":
        return target.kind
    if kind == "count":
        return COUNT_WORDS[len(scene.shapes)]
    if kind == "json":
        return json.dumps({"shape": target.kind, "colour": target.colour}, separators=(",", ":"))
    return scene.describe()


def render_size(scene: Scene, rng: random.Random, min_side: int = 64, max_side: int = 640) -> tuple[int, int]:
    """A random resolution with the scene's aspect ratio."""
    short = rng.randint(min_side, max_side)
    if scene.aspect >= 1:
        return max(min_side, round(short * scene.aspect)), short
    return short, max(min_side, round(short / scene.aspect))


def _background(scene: Scene, width: int, height: int) -> np.ndarray:
    a, b = (np.array(t, dtype=np.float32) for t in scene.tones)
    if scene.background == "plain":
        return np.broadcast_to(a, (height, width, 3)).astype(np.uint8)
    if scene.background == "noise":
        rng = np.random.default_rng(scene.noise_seed)
        return (a + rng.normal(0, 14, (height, width, 1))).clip(0, 255).astype(np.uint8)
    period = max(2.0, scene.period * min(width, height))
    y, x = np.mgrid[0:height, 0:width]
    if scene.background == "stripes":
        mask = (x // period) % 2 == 0
    else:
        mask = ((x // period) + (y // period)) % 2 == 0
    return np.where(mask[..., None], a, b).astype(np.uint8)


def _draw(draw: ImageDraw.ImageDraw, shape: Shape, cx: float, cy: float, r: float) -> None:
    if shape.kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=shape.rgb)
    elif shape.kind == "square":
        half = r * SQUARE_HALF
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), fill=shape.rgb)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r * TRIANGLE_BASE), (cx - r, cy + r * TRIANGLE_BASE)], fill=shape.rgb)


def _inside(kind: str, dx: np.ndarray, dy: np.ndarray, r: float) -> np.ndarray:
    """Whether offsets from a shape's centre fall inside it (the geometry `_draw` draws)."""
    if kind == "circle":
        return dx**2 + dy**2 <= r**2
    if kind == "square":
        return np.maximum(abs(dx), abs(dy)) <= r * SQUARE_HALF
    # Triangle: half-width grows from 0 at the apex (dy = -r) to r at the base.
    depth = (dy + r) / (r * (1 + TRIANGLE_BASE))
    return (depth >= 0) & (depth <= 1) & (abs(dx) <= r * depth)
