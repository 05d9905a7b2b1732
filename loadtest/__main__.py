"""Load-test any OpenAI-compatible chat endpoint: Prism, vLLM's own server, others.

  python -m loadtest --base-url http://127.0.0.1:8000 --model prism-demo \\
      --buckets 256x256=1,720p=1,1080p=1,4k=1 --concurrency 8 --requests 64
  python -m loadtest ... --sweep-rate 1,2,4,8 --slo-ttft-ms 1000
  python -m loadtest ... --videos short=3,long=1 --video-fraction 0.5 --video-repeat-ratio 0.5 --video-fps 2
(`prism bench ...` is the same command.)
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from rich.console import Console

from loadtest import report as reports
from loadtest.bench import Plan, load_test, sweep
from loadtest.client import Target
from loadtest.runner import Arrival
from loadtest.stats import SLO
from loadtest.videos import VideoMix, parse_lengths
from loadtest.workload import WorkloadSpec, parse_buckets, parse_distribution


def _floats(text: str) -> list[float]:
    return _positive_each([float(v) for v in text.split(",") if v.strip()], text)


def _ints(text: str) -> list[int]:
    return _positive_each([int(v) for v in text.split(",") if v.strip()], text)


def _positive_each(values: list, text: str) -> list:
    """A sweep's loads: each above 0 (one of 0 ended the sweep half-way, its points lost)."""
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"{text}: each load must be > 0")
    return values


def _positive(text: str) -> float:
    if (value := float(text)) <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prism bench", description=__doc__.splitlines()[0])
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    target.add_argument("--model", default="prism-demo")
    target.add_argument("--api-key", default=None)
    target.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = E2E)")
    target.add_argument("--ignore-eos", action="store_true",
                        help="generate max-tokens for every request (vLLM's extension; Prism honours it)")
    target.add_argument("--timeout-s", type=float, default=300)
    work = p.add_argument_group("workload")
    work.add_argument("--buckets", default="256x256=1,720p=1,1080p=1,4k=1",
                      help="resolutions with weights: names (256x256, 720p, 1080p, 4k, wide-strip, tall-strip) or WxH")
    work.add_argument("--images-per-request", default="1=1", help="distribution, e.g. 0=0.1,1=0.7,2=0.2")
    work.add_argument("--png-fraction", type=float, default=0.0)
    work.add_argument("--repeat-ratio", type=float, default=0.0, help="share of image slots reusing an earlier image")
    work.add_argument("--pool-size", type=int, default=32, help="how many recent new images repeats draw from")
    work.add_argument("--prompt-words", type=int, default=0, help="filler words added to each question")
    work.add_argument("--max-tokens", type=int, default=16)
    work.add_argument("--system-prompts", choices=("none", "fixed", "unique"), default="none")
    work.add_argument("--seed", type=int, default=0, help="sizes, formats, repeats and arrivals")
    work.add_argument("--image-salt", type=int, default=None,
                      help="mixed into every image's pixels (default: a new one each run, so a server that stays up "
                           "sees new images; the report gives it, to send the same images again)")
    video = p.add_argument_group("videos (a share of the requests carry one clip instead of images)")
    video.add_argument("--videos", default=None,
                       help="clip lengths with weights: short (4 s), long (30 s) or <seconds>s, e.g. short=3,long=1,60s=1")
    video.add_argument("--video-fraction", type=float, default=0.5, help="share of requests with a clip")
    video.add_argument("--video-repeat-ratio", type=float, default=0.0, help="share of video requests resending a recent clip")
    video.add_argument("--video-pool-size", type=int, default=8, help="how many recent new clips repeats draw from")
    video.add_argument("--video-size", default="320x240", help="clips' WxH")
    video.add_argument("--video-source-fps", type=float, default=10.0, help="the clips' own frame rate")
    video.add_argument("--video-fps", type=float, default=None, help="sampling rate asked for (media_io_kwargs.video.fps)")
    video.add_argument("--video-max-pixels", type=int, default=None, help="pixel budget per frame (mm_processor_kwargs.max_pixels)")
    load = p.add_argument_group("load")
    arrival = load.add_mutually_exclusive_group()
    arrival.add_argument("--concurrency", type=int, help="closed loop (default 1)")
    arrival.add_argument("--rate", type=float, help="open loop, Poisson requests/s")
    arrival.add_argument("--sweep-concurrency", type=_ints, help="e.g. 1,2,4,8")
    arrival.add_argument("--sweep-rate", type=_floats, help="e.g. 0.5,1,2,4")
    load.add_argument("--requests", type=int, default=100, help="timed requests (per sweep point)")
    load.add_argument("--duration-s", type=_positive, default=None, help="stop issuing after this long")
    load.add_argument("--warmup", type=int, default=2, help="requests sent first and left out")
    load.add_argument("--image-transport", choices=("data", "url"), default="data",
                      help="data URLs, or a local HTTP server the target fetches from")
    load.add_argument("--image-host", default="127.0.0.1",
                      help="address of that server (Prism must allow it: gateway.fetch_allowed_networks)")
    slo = p.add_argument_group("SLO (goodput)")
    slo.add_argument("--slo-ttft-ms", type=float, default=None)
    slo.add_argument("--slo-tpot-ms", type=float, default=None)
    slo.add_argument("--slo-attainment", type=float, default=0.9, help="sweep: share of requests that must meet the SLO")
    out = p.add_argument_group("output")
    out.add_argument("--out-dir", type=Path, default=None, help="write JSON, Markdown and PNG plots here")
    out.add_argument("--name", default="result", help="file name stem in --out-dir")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def video_mix(args) -> VideoMix | None:
    if not args.videos:
        return None
    try:
        width, height = (int(v) for v in args.video_size.lower().split("x"))
    except ValueError:
        raise ValueError(f"--video-size {args.video_size!r}: use WxH, e.g. 640x360") from None
    return VideoMix(parse_lengths(args.videos), args.video_fraction, args.video_repeat_ratio, args.video_pool_size,
                    width, height, args.video_source_fps, args.video_fps, args.video_max_pixels)


def workload(args) -> WorkloadSpec:
    return WorkloadSpec(
        buckets=parse_buckets(args.buckets), images_per_request=parse_distribution(args.images_per_request),
        png_fraction=args.png_fraction, repeat_ratio=args.repeat_ratio, pool_size=args.pool_size,
        prompt_words=args.prompt_words, max_tokens=args.max_tokens, system_prompts=args.system_prompts, seed=args.seed,
        image_salt=random.getrandbits(48) if args.image_salt is None else args.image_salt, videos=video_mix(args),
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        spec = workload(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    target = Target(args.base_url.rstrip("/"), args.model, args.api_key, not args.no_stream, args.timeout_s, args.ignore_eos)
    plan = Plan(args.requests, args.duration_s, args.warmup, args.image_transport, args.image_host, progress=not args.quiet)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    console = Console()
    console.print(f"images and clips salted with {spec.image_salt} (--image-salt {spec.image_salt} sends the same ones again)")
    if args.sweep_concurrency or args.sweep_rate:
        kind = "concurrency" if args.sweep_concurrency else "rate"
        result = sweep(target, spec, args.sweep_concurrency or args.sweep_rate, kind, plan, slo, args.slo_attainment)
        console.print(reports.sweep_markdown(result))
        if args.out_dir:
            for path in reports.write_sweep(result, args.out_dir, args.name):
                console.print(f"wrote {path}")
        return 0
    try:  # 0 is refused there, not taken for "unset"
        arrival = (Arrival(rate=args.rate, seed=args.seed) if args.rate is not None
                   else Arrival(concurrency=1 if args.concurrency is None else args.concurrency))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = load_test(target, spec, arrival, plan, slo)
    reports.terminal(result, console)
    if args.out_dir:
        for path in reports.write(result, args.out_dir, args.name):
            console.print(f"wrote {path}")
    return 0 if result["summary"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
