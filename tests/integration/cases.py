"""Images and conversations shared by the Prism tests and the vLLM reference run.

Everything is generated from fixed seeds, so the reference (vLLM in-process,
raw images) and Prism see byte-identical inputs.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.synthetic import make_image

# The pixel budget for the test stack and the reference: small enough that
# several test images exceed it and are downscaled by the gateway.
TEST_MAX_PIXELS = 256 * 28 * 28
TEST_MIN_PIXELS = 56 * 56
MAX_TOKENS = 12
# vLLM's own top two tokens this close in log-probability are a tie to float32
# noise: Prism's encoder runs transformers' tower and vLLM its own, so sums in
# another order may break it the other way (LLaVA-OneVision's 1280×960 image:
# 0.000116 apart at its last token).
TIE_LOGPROB = 1e-3

# name → (width, height): tiny, square, non-square, portrait, wide strip, over budget, ...
PARITY_IMAGES = {
    "tiny": (20, 12),
    "square": (224, 224),
    "landscape": (640, 480),
    "portrait": (280, 500),
    "strip": (600, 150),
    "large": (1280, 960),
    "odd": (333, 257),
}
# Used by the concurrency test alone, so that they reach the encoder uncached
# and get batched together; mixed sizes, two over the budget.
CONCURRENT_IMAGES = {f"c{i}": (64 + 61 * i, 400 - 19 * i) for i in range(14)} | {"c14": (900, 700), "c15": (500, 1000)}
ALL_IMAGES = {**PARITY_IMAGES, **CONCURRENT_IMAGES}


def write_images(directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, size in ALL_IMAGES.items():
        path = directory / f"{name}.png"
        make_image(name, size).save(path, format="PNG")
        paths[name] = path
    return paths


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


@dataclass(frozen=True)
class Case:
    """A conversation; image parts name an image by key ({"type": "image", "name": ...})."""

    name: str
    messages: list = field(hash=False)
    max_tokens: int = MAX_TOKENS

    def image_names(self) -> list[str]:
        return [p["name"] for m in self.messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]

    def openai_messages(self, images: dict[str, Path]) -> list[dict]:
        """The conversation as an OpenAI client sends it (images as data: URLs)."""

        def part(p):
            if p["type"] == "image":
                return {"type": "image_url", "image_url": {"url": data_url(images[p["name"]])}}
            return p

        return [
            {**m, "content": m["content"] if isinstance(m["content"], str) else [part(p) for p in m["content"]]}
            for m in self.messages
        ]


def one_image(name: str, question: str = "What is in this picture?") -> Case:
    return Case(f"image-{name}", [{"role": "user", "content": [{"type": "image", "name": name}, {"type": "text", "text": question}]}])


CASES = {
    case.name: case
    for case in [
        *(one_image(name) for name in ALL_IMAGES),
        Case("two-images", [{"role": "user", "content": [
            {"type": "text", "text": "Compare these two:"},
            {"type": "image", "name": "square"},
            {"type": "image", "name": "portrait"},
            {"type": "text", "text": "Which is larger?"},
        ]}]),
        Case("text-only", [{"role": "user", "content": "Describe a red circle on a blue background."}]),
        Case("two-turns", [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": [{"type": "image", "name": "odd"}, {"type": "text", "text": "What shape is there?"}]},
            {"role": "assistant", "content": "a circle"},
            {"role": "user", "content": "And what colour is it?"},
        ]),
    ]
}


# What test_families asks every family; the other cases (eight more concurrent
# images, the text-only question) are the demo model's, in the session's reference.
FAMILY_CONCURRENT_IMAGES = list(CONCURRENT_IMAGES)[:8]
FAMILY_CASES = (
    [f"image-{name}" for name in PARITY_IMAGES]
    + [f"image-{name}" for name in FAMILY_CONCURRENT_IMAGES]
    + ["two-images", "two-turns"]
)


def matches_reference(text: str, expected: dict) -> bool:
    """Prism's greedy answer is vLLM's (reference_vllm.py's record), or is it up
    to a token where vLLM's own top two tied, after which the two may differ."""
    if text == expected["text"]:
        return True
    split = next((k for k, prefix in enumerate(expected["prefixes"]) if not text.startswith(prefix)), None)
    return split is not None and expected["margins"][split] < TIE_LOGPROB
