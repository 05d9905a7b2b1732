"""Gateway intake throughput and its share of TTFT.

1. images/s through the gateway's intake (base64 decode, header inspection,
   decode, EXIF, RGB, downscale to the 1,048,576-pixel budget, digest) for
   1080p JPEGs (q90), with 1 worker thread and with one per core, side by side.
2. The intake stages' share of TTFT for 1080p requests through the running
   stack (cache miss and hit), from the per-request breakdown.

Run: .venv/bin/python -m bench.intake [--images 48]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.intake import ImageLimits, IntakePolicy, decode, decode_data_url, inspect
from prism.stack import LocalStack
from prism.synthetic import data_url, make_image
from protocol.to_gateway import ProcessorInfo

POLICY = IntakePolicy(ProcessorInfo(14, 2, 3136, 1024 * 1024), ImageLimits(20 * 2**20, 50_000_000, 2, 200))


def intake_one(url: str) -> None:
    raw = decode_data_url(url, "bench", POLICY.limits.max_bytes)
    decode(inspect(raw, "bench", POLICY, POLICY.default_budget), POLICY)


def throughput(urls: list[str], workers: int) -> float:
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(intake_one, urls[:workers]))  # warm-up
        started = time.perf_counter()
        list(pool.map(intake_one, urls))
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
    args = parser.parse_args()
    urls = [data_url(make_image(f"intake-{i}", (1920, 1080))) for i in range(args.images)]
    cores = os.cpu_count() or 1
    one = throughput(urls, 1)
    every = throughput(urls, cores)
    print(f"| workers | 1080p JPEG images/s |\n|---|---|\n| 1 | {one:.1f} |\n| {cores} | {every:.1f} ({every / one:.2f}×) |")
    share = intake_share(urls[:8])
    print(f"\nintake (image_fetch + image_preprocess) share of TTFT, 1080p, median of 8: miss {share['miss']:.0%}, hit {share['hit']:.0%}")


if __name__ == "__main__":
    main()
