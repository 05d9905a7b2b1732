"""TTFT of a new and of a repeated video through the Prism stack, concurrency 1
(issue 46; figures in docs/measurements/video-repeat.md).

A 10 s clip (10 fps, `--size`, 320×240 by default) sampled at the loader's default 2 fps (20
frames): each trial sends a clip never seen, then the same clip again, one
request at a time, max_tokens 1. Reported per kind: the median TTFT the
gateway measured (arrival to first token, `prism.stages_ms.ttft`), the
median client-side latency, and the median of the gateway's `video_decode`
and the encoder's `encode` stages. The stack runs the code of the checkout
it is started from, so main's figure comes from running this file in an
export of main's tree.

Run: .venv/bin/python -m bench.video_repeat --trials 5
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from loadtest.clips import ClipSpec, make_clip
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import LocalStack

SECONDS, FPS = 10, 10.0
CPU_STACK = {"PRISM_ENCODER__DTYPE": "float32", "PRISM_ENGINE__DTYPE": "float32",
             "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256"}  # as the tests' stack: a CPU host


def ask(client: OpenAI, model: str, raw: bytes) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    started = time.perf_counter()
    reply = client.chat.completions.create(model=model, max_tokens=1, temperature=0, messages=[{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What moves in this clip?"}]}])
    latency = (time.perf_counter() - started) * 1000
    stages = reply.model_extra["prism"]["stages_ms"]
    return {"ttft_ms": stages["ttft"], "latency_ms": latency, "video_decode_ms": stages.get("video_decode", 0.0),
            "encode_ms": stages.get("encode", 0.0), "hits": reply.model_extra["prism"]["cache"]["hits"]}


def medians(rows: list[dict]) -> dict:
    return {key: round(statistics.median(row[key] for row in rows), 1) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--size", default="320x240", help="the clip's frame size, WxH")
    parser.add_argument("--gpu", action="store_true", help="the stack's own dtypes, not the CPU host's float32")
    args = parser.parse_args()
    size = tuple(int(side) for side in args.size.split("x"))
    ensure_demo_model(RANDOM_MODEL)
    overrides = {} if args.gpu else CPU_STACK
    with tempfile.TemporaryDirectory() as run_dir, LocalStack(Path(run_dir), overrides) as stack:
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        ask(client, model, make_clip(ClipSpec(*size, FPS, SECONDS * int(FPS), seed=999)))  # warm-up
        new, repeat = [], []
        for trial in range(args.trials):
            raw = make_clip(ClipSpec(*size, FPS, SECONDS * int(FPS), seed=trial))
            new.append(ask(client, model, raw))
            repeat.append(ask(client, model, raw))
    print(json.dumps({"size": args.size, "new": medians(new), "repeat": medians(repeat), "trials": args.trials}))


if __name__ == "__main__":
    main()
