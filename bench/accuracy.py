"""How well the trained demo model sees, measured through the whole served path.

Held-out scenes (their own seed, never seen in training) are rendered at
varied resolutions and aspect ratios, sent as images through the gateway with
the official `openai` client, encoded by the vision encoder service and
answered by the LLM engine. Prints accuracy per question kind against the bars
of issue #9 (colour ≥ 95 %, shape and count ≥ 90 %).

Run: python -m bench.accuracy                # starts a stack on models/prism-shapes
     python -m bench.accuracy --base-url http://127.0.0.1:8000 --per-kind 50
"""

from __future__ import annotations

import argparse
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI
from rich.console import Console
from rich.table import Table

from prism import scenes
from prism.demo_model import SHAPES_MODEL
from prism.stack import LocalStack
from prism.synthetic import data_url

BARS = {"colour": 0.95, "shape": 0.90, "count": 0.90}
HELD_OUT_SEED = "prism-held-out"


@dataclass(frozen=True)
class Case:
    scene: scenes.Scene
    question: scenes.Question
    size: tuple[int, int]


def held_out(per_kind: int, seed: str = HELD_OUT_SEED, min_side: int = 128, max_side: int = 1024) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for kind in scenes.KINDS:
        for _ in range(per_kind):
            scene = scenes.make_scene(rng)
            cases.append(Case(scene, scenes.ask(scene, rng, kind), scenes.render_size(scene, rng, min_side, max_side)))
    return cases


def ask(client: OpenAI, model: str, image_url: str, question: str) -> str:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": question},
        ]}],
        max_tokens=24,
        temperature=0,
    )
    return response.choices[0].message.content


def normalise(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())


def answers(client: OpenAI, model: str, cases: list[Case], concurrency: int = 8) -> list[str]:
    def one(case: Case) -> str:
        return ask(client, model, data_url(case.scene.render(*case.size), "PNG"), case.question.text)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, cases))


def accuracy(cases: list[Case], replies: list[str]) -> dict[str, tuple[int, int]]:
    """Question kind → (right, asked)."""
    scores: dict[str, list[int]] = {}
    for case, reply in zip(cases, replies):
        right, asked = scores.setdefault(case.question.kind, [0, 0])
        scores[case.question.kind] = [right + (normalise(reply) == normalise(case.question.answer)), asked + 1]
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
    parser.add_argument("--per-kind", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    cases = held_out(args.per_kind)
    with tempfile.TemporaryDirectory() as run_dir:
        stack = None if args.base_url else LocalStack(Path(run_dir), model=SHAPES_MODEL).start()
        try:
            client = OpenAI(base_url=f"{args.base_url or stack.base_url}/v1", api_key="unused", timeout=120)
            scores = accuracy(cases, answers(client, args.model, cases, args.concurrency))
        finally:
            if stack:
                stack.stop()
    Console().print(table(scores))
    for case in cases[: len(scenes.KINDS) * args.per_kind : args.per_kind][:4]:
        print(f"e.g. {case.size[0]}×{case.size[1]}: {case.question.text!r} → expected {case.question.answer!r}")


if __name__ == "__main__":
    main()
