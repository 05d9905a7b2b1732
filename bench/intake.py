"""Gateway intake throughput and its share of TTFT.

1. Images/s through the gateway's intake: base64 decode, header inspection,
   decode, EXIF, RGB, downscale, digest. It runs on JPEGs (q90) of one
   resolution (4K by default) in four settings: a 1 MP pixel budget and the
   demo model's 140×140, each with the full decode and the draft decode
   (`gateway.jpeg_draft`). Each setting runs with 1 worker thread and with
   one per core, side by side. This is the ceiling one gateway process's
   intake puts on images per second.
2. The intake stages' share of TTFT for requests through the running stack
   (the demo config; cache miss and hit), from the per-request breakdown.

Run: .venv/bin/python -m bench.intake [--images 48] [--resolution 1920x1080]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.intake.images import ImageLimits, IntakePolicy, decode, decode_data_url, inspect
from testing.stack import LocalStack
from loadtest.synthetic import data_url, make_image
from protocol.to_gateway import ProcessorInfo

BUDGETS = {"1 MP": 1024 * 1024, "140×140 (demo)": 140 * 140}


def qwen_policy(max_pixels: int, jpeg_draft: bool = False) -> IntakePolicy:
    """The gateway's intake for a Qwen pixel budget, with the default image limits."""
    return IntakePolicy(ProcessorInfo(14, 2, 56 * 56, max_pixels, "Qwen2VLVideoProcessor"), ImageLimits(20 * 2**20, 50_000_000, 2, 200), jpeg_draft)


def intake_one(url: str, policy: IntakePolicy) -> None:
    raw = decode_data_url(url, "bench", policy.limits)
    decode(inspect(raw, "bench", policy, policy.default_budget), policy)


def throughput(urls: list[str], workers: int, policy: IntakePolicy) -> float:
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(intake_one, urls[:workers], [policy] * workers))  # warm-up
        started = time.perf_counter()
        list(pool.map(intake_one, urls, [policy] * len(urls)))
        return len(urls) / (time.perf_counter() - started)


def intake_share(urls: list[str]) -> dict[str, float]:
    from openai import OpenAI

    shares: dict[str, list[float]] = {"miss": [], "hit": []}
    with tempfile.TemporaryDirectory() as run_dir, LocalStack(Path(run_dir)) as stack:
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        for url in urls:
            for kind in ("miss", "hit"):
                response = client.chat.completions.create(
                    model="prism-demo", max_tokens=1,
                    messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                )
                stages = response.model_extra["prism"]["stages_ms"]
                shares[kind].append((stages["image_fetch"] + stages["image_preprocess"]) / stages["ttft"])
    return {kind: statistics.median(values) for kind, values in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--resolution", default="3840x2160")
    args = parser.parse_args()
    width, height = map(int, args.resolution.split("x"))
    urls = [data_url(make_image(f"intake-{i}", (width, height))) for i in range(args.images)]
    cores = os.cpu_count() or 1
    print(f"| budget | decode | 1 worker, images/s | {cores} workers, images/s |\n|---|---|---|---|")
    for name, max_pixels in BUDGETS.items():
        for draft in (False, True):
            policy = qwen_policy(max_pixels, draft)
            one, every = throughput(urls, 1, policy), throughput(urls, cores, policy)
            print(f"| {name} | {'draft' if draft else 'full'} | {one:.1f} | {every:.1f} ({every / one:.2f}×) |", flush=True)
    share = intake_share(urls[:8])
    print(f"\nintake (image_fetch + image_preprocess) share of TTFT, {args.resolution}, median of 8: "
          f"miss {share['miss']:.0%}, hit {share['hit']:.0%}")


if __name__ == "__main__":
    main()
