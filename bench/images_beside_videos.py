"""An image request's time to first token while long videos decode beside it,
against the same kind of request alone, in one run on the demo Prism stack.

Each round sends a new image alone, then two new long clips at once and,
once their decodes are under way, another new image: both images' TTFT
and stages, and the clips' `video_decode`. Images and videos are taken in by
the gateway's intake threads; a long decode that held the threads an image
needs would show as that image's wait (its `image_fetch` stage, where a data URL
is decoded on those threads, its `image_preprocess`, and TTFT).
Figures go to docs/measurements/images-beside-videos.md.

    python -m bench.images_beside_videos --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import httpx

from gateway.timing import TTFT_STAGES
from loadtest.client import Target, send
from loadtest.runner import image_urls
from loadtest.videos import VideoSpec
from loadtest.workload import RequestSpec, WorkloadSpec, generate, parse_buckets
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import LocalStack

SERVED_NAME = "prism-demo"
LONG_CLIP = (1280, 720, 30.0, 60.0)  # width, height, source fps, seconds: read to its last kept frame, seconds of a core
SAMPLE_FPS = 0.5
CLIP_MAX_PIXELS = 128 * 128  # the encoder's and engine's share kept small: this is about the gateway
DECODES_UNDER_WAY_S = 0.5  # from the clips' sending to the image's: their fetch and header read are done by then
MAX_TOKENS = 4


def requests_for(rounds: int) -> tuple[list[RequestSpec], list[tuple[RequestSpec, RequestSpec]]]:
    """Every image new (2 per round and a warm-up), every clip new (2 per round)."""
    images = generate(WorkloadSpec(parse_buckets("448x336=1"), max_tokens=MAX_TOKENS, seed=7100), 2 * rounds + 1)
    width, height, fps, seconds = LONG_CLIP
    clips = [RequestSpec(len(images) + n, (), "What moves in this clip?", None, MAX_TOKENS,
                         (VideoSpec(f"{seconds:g}s", width, height, fps, seconds, 7200 + n),), False, SAMPLE_FPS,
                         CLIP_MAX_PIXELS) for n in range(2 * rounds)]
    return images, list(zip(clips[::2], clips[1::2]))


async def rounds_of(target: Target, images: list[RequestSpec], clip_pairs, urls_of) -> dict:
    alone, beside, decodes = [], [], []
    async with httpx.AsyncClient(timeout=target.timeout_s) as client:
        await send(client, target, images[0], urls_of(images[0]))  # warm-up
        for n, pair in enumerate(clip_pairs):
            alone.append(await send(client, target, images[1 + 2 * n], urls_of(images[1 + 2 * n])))
            clips = [asyncio.create_task(send(client, target, clip, urls_of(clip))) for clip in pair]
            await asyncio.sleep(DECODES_UNDER_WAY_S)
            beside.append(await send(client, target, images[2 + 2 * n], urls_of(images[2 + 2 * n])))
            decodes += await asyncio.gather(*clips)
    failed = [r.error for r in alone + beside + decodes if not r.ok]
    if failed:
        raise RuntimeError(f"requests failed: {failed}")
    return {"alone": alone, "beside": beside, "clips": decodes}


def _median(results, stage: str | None = None) -> float:
    return statistics.median(r.ttft_s * 1000 if stage is None else r.stages_ms.get(stage, 0.0) for r in results)


def report(results: dict) -> None:
    alone, beside = results["alone"], results["beside"]
    stages = [stage for stage in TTFT_STAGES if any(r.stages_ms.get(stage, 0) > 0 for r in alone + beside)]
    print(f"{'image request':22} {'TTFT p50':>10} " + " ".join(f"{stage:>{max(len(stage), 9)}}" for stage in stages))
    for name, chosen in (("alone", alone), ("beside 2 clip decodes", beside)):
        print(f"{name:22} {_median(chosen):7.0f} ms " + " ".join(f"{_median(chosen, stage):{max(len(stage), 9) - 3}.1f} ms"
                                                         for stage in stages))
    print(f"TTFT beside / alone: {_median(beside) / _median(alone):.2f}; the clips' video_decode p50 "
          f"{_median(results['clips'], 'video_decode'):.0f} ms, TTFT p50 {_median(results['clips']):.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ensure_demo_model(RANDOM_MODEL)
    images, clip_pairs = requests_for(args.rounds)
    with tempfile.TemporaryDirectory() as run_dir, LocalStack(Path(run_dir)) as stack:
        with image_urls(images + [clip for pair in clip_pairs for clip in pair], "data") as urls_of:
            results = asyncio.run(rounds_of(Target(stack.base_url, SERVED_NAME), images, clip_pairs, urls_of))
    report(results)


if __name__ == "__main__":
    main()
