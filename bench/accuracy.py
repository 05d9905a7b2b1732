"""How well the trained demo model sees, measured through the whole served path.

Held-out scenes (their own seed, never seen in training) are rendered at
varied resolutions and aspect ratios, sent as images through the gateway with
the official `openai` client, encoded by the vision encoder service and
answered by the LLM engine. Prints accuracy per question kind against the bars
of issue #9 (colour ≥ 95 %, shape and count ≥ 90 %). "json" questions are
asked of one-shape scenes with `response_format` set to the scene schema;
right means the parsed object is the expected one. "turns" questions ("What
colour does the square turn?") are asked of held-out mp4 clips
(prism/scene_clips.py) sent as `video_url` parts: the gateway samples and
decodes them as vLLM's server would, and the encoder runs the checkpoint's
video processor.

Run: python -m bench.accuracy                # starts a stack on models/prism-shapes
     python -m bench.accuracy --base-url http://127.0.0.1:8000 --per-kind 50
     python -m bench.accuracy --format JPEG --jpeg-draft   # the gateway's draft JPEG decoding
     python -m bench.accuracy --kinds turns --per-kind 200    # the video question alone
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI
from rich.console import Console
from rich.table import Table

from prism import scene_clips, scenes
from prism.demo_model import SHAPES_MODEL
from testing.stack import LocalStack
from loadtest.synthetic import data_url

BARS = {"colour": 0.95, "shape": 0.90, "count": 0.90, "json": 0.90}
KINDS = (*scenes.KINDS, "json", scene_clips.KIND)
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "shape", "schema": scenes.JSON_SCHEMA, "strict": True}}
HELD_OUT_SEED = "prism-held-out"


@dataclass(frozen=True)
class Case:
    scene: scenes.Scene
    question: scenes.Question
    size: tuple[int, int]
    clip: scene_clips.TurningClip | None = None  # a video question: the clip is sent, not the scene

    def media_part(self, fmt: str = "PNG") -> dict:
        if self.clip is not None:
            return video_part(self.clip.mp4())
        return {"type": "image_url", "image_url": {"url": data_url(self.scene.render(*self.size), fmt)}}


def held_out(per_kind: int, seed: str = HELD_OUT_SEED, min_side: int = 128, max_side: int = 1024,
             kinds: tuple[str, ...] = KINDS) -> list[Case]:
    """`per_kind` cases of each kind in `kinds`: the same ones whichever kinds are asked."""
    rng = random.Random(seed)
    cases = [_case(rng, kind, min_side, max_side) for kind in KINDS for _ in range(per_kind)]
    return [case for case in cases if case.question.kind in kinds]


def _case(rng: random.Random, kind: str, min_side: int, max_side: int) -> Case:
    if kind == scene_clips.KIND:
        clip = scene_clips.make_clip(rng)
        return Case(clip.before, clip.question(rng), clip.size, clip)
    scene = scenes.make_scene(rng, 1 if kind == "json" else None)
    return Case(scene, scenes.ask(scene, rng, kind), scenes.render_size(scene, rng, min_side, max_side))


def video_part(mp4: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}}


def ask(client: OpenAI, model: str, image_url: str, question: str, response_format: dict | None = None) -> str:
    return ask_about(client, model, {"type": "image_url", "image_url": {"url": image_url}}, question, response_format)


def ask_about(client: OpenAI, model: str, part: dict, question: str, response_format: dict | None = None) -> str:
    """The answer to `question` about one image or video `part`, greedy."""
    constrained = {"response_format": response_format} if response_format else {}
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": question}]}],
        max_tokens=24,
        temperature=0,
        **constrained,
    )
    return response.choices[0].message.content


def normalise(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())


def is_right(question: scenes.Question, reply: str) -> bool:
    if question.kind != "json":
        return normalise(reply) == normalise(question.answer)
    try:
        return json.loads(reply) == json.loads(question.answer)
    except json.JSONDecodeError:
        return False


def answers(client: OpenAI, model: str, cases: list[Case], concurrency: int = 8, fmt: str = "PNG") -> list[str]:
    def one(case: Case) -> str:
        constrained = JSON_FORMAT if case.question.kind == "json" else None
        return ask_about(client, model, case.media_part(fmt), case.question.text, constrained)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, cases))


def accuracy(cases: list[Case], replies: list[str]) -> dict[str, tuple[int, int]]:
    """Question kind → (right, asked)."""
    scores: dict[str, list[int]] = {}
    for case, reply in zip(cases, replies):
        right, asked = scores.setdefault(case.question.kind, [0, 0])
        scores[case.question.kind] = [right + is_right(case.question, reply), asked + 1]
    return {kind: (right, asked) for kind, (right, asked) in scores.items()}


def table(scores: dict[str, tuple[int, int]]) -> Table:
    out = Table(title="Demo model accuracy, held-out scenes, through gateway → encoder → engine")
    for column in ("question", "right", "asked", "accuracy", "bar"):
        out.add_column(column, justify="left" if column == "question" else "right")
    for kind, (right, asked) in scores.items():
        bar = BARS.get(kind)
        verdict = "" if bar is None else f"{bar:.0%} {'met' if right / asked >= bar else 'MISSED'}"
        out.add_row(kind, str(right), str(asked), f"{right / asked:.1%}", verdict)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running Prism; default: start one on the trained demo model")
    parser.add_argument("--model", default="prism-demo")
    parser.add_argument("--checkpoint", type=Path, default=SHAPES_MODEL, help="the checkpoint the started stack serves")
    parser.add_argument("--per-kind", type=int, default=100)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="the question kinds asked")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--format", default="PNG", choices=["PNG", "JPEG"], help="how the scenes are sent")
    parser.add_argument("--jpeg-draft", action="store_true", help="the started stack decodes JPEGs in draft (gateway.jpeg_draft)")
    args = parser.parse_args()
    cases = held_out(args.per_kind, kinds=tuple(args.kinds))
    overrides = {"PRISM_GATEWAY__JPEG_DRAFT": "true"} if args.jpeg_draft else {}
    with tempfile.TemporaryDirectory() as run_dir:
        stack = None if args.base_url else LocalStack(Path(run_dir), overrides, model=args.checkpoint).start()
        try:
            client = OpenAI(base_url=f"{args.base_url or stack.base_url}/v1", api_key="unused", timeout=120)
            scores = accuracy(cases, answers(client, args.model, cases, args.concurrency, args.format))
        finally:
            if stack:
                stack.stop()
    Console().print(table(scores))
    for case in cases[:: args.per_kind]:
        print(f"e.g. {case.size[0]}×{case.size[1]}: {case.question.text!r} → expected {case.question.answer!r}")


if __name__ == "__main__":
    main()
