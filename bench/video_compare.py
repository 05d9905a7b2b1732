"""Prism against vLLM's own OpenAI server on videos, in one run (issue #46's goals).

Starts vLLM's server (`python -m vllm.entrypoints.openai.api_server`, raw
videos and images, the same checkpoint, pixel budget and engine settings as
bench/compare.py), runs every scenario against it, stops it; then the same
for the Prism stack; then Prism once more with a smaller gateway memory
limit, for (d) only. One system runs at a time; both get the same seeded
clips, images and questions, and are asked to sample alike per request
(`media_io_kwargs.video.fps`, `mm_processor_kwargs.max_pixels`, which vLLM
0.32's server takes per request only when started with
`--trust-request-mm-kwargs`; it answers 400 otherwise). Every clip's prompt-token count must be the
same on both systems, or the run fails: a different count would mean the two
did not sample or size the clip alike, and their times could not be compared.

  (a) a new 10 s clip sampled at 2 fps, one request at a time
  (b) a second, different question about (a)'s clip, right after it
  (c) a closed loop of 8 in flight over a mix: half the requests an image
      (256², 720p), half a clip (4 s or 10 s; half of the clips repeats)
  (d) 8 long clips (60 s, 120 frames kept each) sent at once: the gateway's
      peak RSS (vLLM: its API server process, which decodes there), against
      the gateway's memory budget (gateway.memory_limit_bytes ×
      gateway.memory_use_fraction, less its own memory at start); then again
      on a Prism stack with a smaller gateway.memory_limit_bytes: the peak
      follows the setting, the clips wait for room instead of failing.

Writes bench/results/video-compare.{json,md} and, unless --no-record, a dated
entry at the top of docs/measurements/video-compare.md.

Run: .venv/bin/python -m bench.video_compare [--scale 0.5] [--no-record]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import psutil

from bench.servers import vllm_server
from bench.video_memory import PeakRss, budget_of
from bench.video_report import markdown, prompt_token_mismatches, record
from common.config import REPO_ROOT
from gateway.config import GatewayConfig
from gateway.intake.memory import DECODER_PROCESS_BYTES, IDLE_DECODERS
from gateway.intake.resize import smart_resize
from gateway.intake.video.limits import OPENING_FRAMES, decoding_bytes
from gateway.intake.video.sampling import SourceInfo
from loadtest.bench import build_report
from loadtest.client import Target, send
from loadtest.runner import Arrival, image_urls, run
from loadtest.stats import SLO, stage_medians, summarize
from loadtest.videos import VideoMix, VideoSpec, parse_lengths
from loadtest.workload import RequestSpec, WorkloadSpec, generate, parse_buckets, render
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import LocalStack

MODEL = RANDOM_MODEL
SERVED_NAME = "prism-demo"
MAX_PIXELS = 1024 * 1024  # the checkpoint's own image and video budget, given to both systems
SAMPLE_FPS = 2.0
QUESTIONS = ("What moves in this clip?", "Which shape changes colour, and when?")
# Decodes that wait for room in a small budget must not time out while the 8 clips take turns.
MEMORY_WAIT_S = 300
WARMUP = 2  # (c)'s requests sent first and left out
SMALL_BUDGET_CLIPS = 3.5  # (d)'s smaller budget: room for this many decodes at once
CLIP_BYTES_ROOM = 16 * 2**20  # a header read's copy of its clip's bytes, rounded up: (d)'s clips are a few MB
MEMORY_USE_FRACTION = 0.8  # configs/cpu-demo.yaml's gateway.memory_use_fraction
DEMO_FACTOR, DEMO_MIN_PIXELS = 28, 3136  # the demo model's video processor: patch × merge, size["shortest_edge"]


@dataclass(frozen=True)
class Sizes:
    """What each scenario sends; --scale and the smoke test shrink it."""

    new_clips: int = 6  # (a) and (b): each clip asked twice
    clip: tuple[int, int, float, float] = (640, 360, 10.0, 10.0)  # width, height, source fps, seconds
    clip_max_pixels: int | None = None  # (a)/(b)'s mm_processor_kwargs.max_pixels; None: the checkpoint's budget
    mixed_requests: int = 128  # (c): enough that the closed loop's ramp and tail do not make its throughput figure
    mixed_in_flight: int = 8
    mixed_clip_size: tuple[int, int] = (480, 270)
    mixed_lengths: str = "4s=1,10s=1"
    mixed_images: str = "256x256=1,720p=1"
    long_clips: int = 8  # (d), all at once
    long_clip: tuple[int, int, float, float] = (640, 480, 10.0, 60.0)
    long_max_pixels: int = 128 * 128  # the encoder's and engine's share kept small: (d) is about the gateway
    max_tokens: int = 8

    def scaled(self, scale: float) -> "Sizes":
        return replace(self, new_clips=max(2, round(self.new_clips * scale)),
                       mixed_requests=max(self.mixed_in_flight, round(self.mixed_requests * scale)))


def clip_requests(sizes: Sizes, seed: int) -> list[RequestSpec]:
    """(a) and (b): each new clip asked QUESTIONS[0], then QUESTIONS[1]; a warm-up clip first."""
    width, height, fps, seconds = sizes.clip
    requests = []
    for n in range(sizes.new_clips + 1):
        video = VideoSpec(f"{seconds:g}s", width, height, fps, seconds, seed + n)
        for repeat, question in enumerate(QUESTIONS):
            requests.append(RequestSpec(len(requests), (), question, None, sizes.max_tokens, (video,), bool(repeat), SAMPLE_FPS,
                                        sizes.clip_max_pixels))
    return requests


def mixed_workload(sizes: Sizes, seed: int) -> WorkloadSpec:
    width, height = sizes.mixed_clip_size
    mix = VideoMix(parse_lengths(sizes.mixed_lengths), fraction=0.5, repeat_ratio=0.5, pool_size=4, width=width,
                   height=height, source_fps=10.0, sample_fps=SAMPLE_FPS)
    return WorkloadSpec(parse_buckets(sizes.mixed_images), max_tokens=sizes.max_tokens, seed=seed, videos=mix)


def long_requests(sizes: Sizes, seed: int) -> list[RequestSpec]:
    width, height, fps, seconds = sizes.long_clip
    return [RequestSpec(n, (), QUESTIONS[0], None, sizes.max_tokens,
                        (VideoSpec(f"{seconds:g}s", width, height, fps, seconds, seed + n),), False, SAMPLE_FPS,
                        sizes.long_max_pixels) for n in range(sizes.long_clips)]


async def one_at_a_time(target: Target, requests: list[RequestSpec], urls_of) -> list:
    """In order, each after the last has ended (a second question right after its clip's first)."""
    async with httpx.AsyncClient(timeout=target.timeout_s) as client:
        return [await send(client, target, request, urls_of(request)) for request in requests]


def first_and_second(target: Target, sizes: Sizes) -> dict:
    """(a) and (b), the warm-up clip left out."""
    requests = clip_requests(sizes, seed=4600)
    with image_urls(requests, "data") as urls_of:
        results = asyncio.run(one_at_a_time(target, requests, urls_of))[len(QUESTIONS):]
    out = {}
    for key, repeat in (("a", False), ("b", True)):
        chosen = [r for r in results if r.bucket.endswith("-repeat") == repeat]
        out[key] = {"summary": summarize(chosen, sum(r.e2e_s for r in chosen)), "prompt_tokens": _tokens(chosen),
                    "stages": next(iter(stage_medians(chosen).values()), {})}  # one kind each
    return out


def mixed(target: Target, sizes: Sizes) -> dict:
    """(c): closed loop, `mixed_in_flight` at once, seeded; prompt tokens by request for the cross-check."""
    spec, arrival = mixed_workload(sizes, seed=4601), Arrival(concurrency=sizes.mixed_in_flight)
    requests = generate(spec, WARMUP + sizes.mixed_requests)
    with image_urls(requests, "data") as urls_of:  # rendered before any clock starts
        asyncio.run(run(target, requests[:WARMUP], urls_of, Arrival(concurrency=WARMUP)))
        outcome = asyncio.run(run(target, requests[WARMUP:], urls_of, arrival))
    result = build_report(target, spec, arrival, outcome, SLO())
    result["prompt_tokens"] = _tokens(outcome.results)
    return result


def long_clips(target: Target, sizes: Sizes, pid: int, budget: int | None, children: bool) -> dict:
    """(d): every long clip at once; the serving process's peak RSS over its RSS just before
    (`children`: with its children's, Prism's gateway's video decoders)."""
    requests = long_requests(sizes, seed=4700)
    rendered = render(requests)  # before the clock and the memory watch
    with image_urls(requests, "data") as urls_of:
        with PeakRss(pid, children) as peak:
            outcome = asyncio.run(run(target, requests, urls_of, Arrival(concurrency=len(requests))))
    decoded = sum(v.clip.num_frames for v in rendered if isinstance(v, VideoSpec))
    return {"summary": summarize(outcome.results, outcome.duration_s), "prompt_tokens": _tokens(outcome.results),
            "rss_before": peak.before, "peak_rss": peak.peak, "budget": budget, "frames_in_files": decoded,
            "kept_frame_bytes": _kept_frame_bytes(sizes)}


def small_memory_limit(gateway_rss: int, sizes: Sizes) -> str:
    """A gateway.memory_limit_bytes whose budget holds about SMALL_BUDGET_CLIPS of (d)'s decodes (and
    at least one header read, which admits frames at the size limit): under one, every clip would be
    refused (413) and the run would show only that; at 8, nothing would wait. Beside the gateway's
    own memory and its idle decoders', which the budget leaves out (gateway/intake/memory.py)."""
    header_read = DECODER_PROCESS_BYTES + OPENING_FRAMES * GatewayConfig().max_video_frame_pixels * 3 + CLIP_BYTES_ROOM
    room = max(SMALL_BUDGET_CLIPS * long_clip_decode(sizes), header_read)
    limit = (gateway_rss + IDLE_DECODERS * DECODER_PROCESS_BYTES + room) / MEMORY_USE_FRACTION
    return f"{math.ceil(limit / 2**20)}MiB"


def long_clip_decode(sizes: Sizes) -> int:
    """What the gateway admits for one of (d)'s decodes: its frames resized to the budget as they are
    read (gateway/intake/video/sizing.py, the demo model's Qwen2-VL sizing), its decoder's frames and
    its decoder process (less that process's copy of the clip, a few MB)."""
    width, height, _, seconds = sizes.long_clip
    kept_size = smart_resize(height, width, DEMO_FACTOR, DEMO_MIN_PIXELS, sizes.long_max_pixels)
    return (decoding_bytes(SourceInfo(0, 0.0, 0.0, width, height), int(seconds * SAMPLE_FPS), kept_size)
            + DECODER_PROCESS_BYTES)


def _kept_frame_bytes(sizes: Sizes) -> int:
    width, height, _, seconds = sizes.long_clip
    return int(seconds * SAMPLE_FPS) * width * height * 3


def _tokens(results) -> dict[int, int]:
    return {r.index: r.prompt_tokens for r in results if r.ok}


def scenarios(base_url: str, sizes: Sizes) -> dict:
    """(a), (b) and (c) against one server."""
    target = Target(base_url, SERVED_NAME)
    out = first_and_second(target, sizes)
    if not out["a"]["summary"]["completed"]:  # nothing to compare: stop before the long scenarios
        raise RuntimeError(f"{base_url} answered none of (a)'s clips: {out['a']['summary']['errors']}")
    print(f"  (a) new clip TTFT p50 {out['a']['summary']['median_ttft_ms']:.0f} ms, "
          f"(b) second question {out['b']['summary']['median_ttft_ms']:.0f} ms", flush=True)
    out["c"] = mixed(target, sizes)
    print(f"  (c) mixed, {sizes.mixed_in_flight} in flight: {out['c']['summary']['request_throughput']:.2f} req/s", flush=True)
    return out


def memory(base_url: str, sizes: Sizes, pid: int, budget: int | None, children: bool = False) -> dict:
    result = long_clips(Target(base_url, SERVED_NAME), sizes, pid, budget, children)
    print(f"  (d) {sizes.long_clips} long clips at once: peak RSS {result['peak_rss'] / 2**20:,.0f} MiB "
          f"(from {result['rss_before'] / 2**20:,.0f}), {result['summary']['completed']} answered", flush=True)
    return result


def api_server_pid(base_url: str) -> int:
    """vLLM's API server: our child process serving `base_url`'s port (it decodes the videos)."""
    port = base_url.rsplit(":", 1)[1]
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = child.cmdline()
            if "vllm.entrypoints.openai.api_server" in cmdline and port in cmdline:
                return child.pid
    raise RuntimeError(f"no vLLM API server of ours listens on {base_url}")


def prism(run_dir: Path, sizes: Sizes, memory_limit: str | None = None, with_scenarios: bool = True) -> dict:
    overrides = {"PRISM_ENCODER__MAX_PIXELS": str(MAX_PIXELS), "PRISM_GATEWAY__MEMORY_WAIT_S": str(MEMORY_WAIT_S)}
    if memory_limit:
        overrides["PRISM_GATEWAY__MEMORY_LIMIT_BYTES"] = memory_limit
    with LocalStack(run_dir, overrides) as stack:
        out = scenarios(stack.base_url, sizes) if with_scenarios else {}
        out["d"] = memory(stack.base_url, sizes, stack.gateway_pid, budget_of(stack.base_url), children=True)
        out["d"]["memory_limit"] = memory_limit or "configs/cpu-demo.yaml's"
    return out


def vllm(run_dir: Path, sizes: Sizes) -> dict:
    trusted = ("--trust-request-mm-kwargs",)  # per-request sampling, as Prism takes it
    with vllm_server(MODEL, SERVED_NAME, MAX_PIXELS, run_dir / "vllm.log", max_videos=1, extra=trusted) as base_url:
        out = scenarios(base_url, sizes)
        out["d"] = memory(base_url, sizes, api_server_pid(base_url), None)
    return out


def _options(argv: list[str]) -> list[str]:
    """The command line as the report shows it: the note is the entry's own paragraph."""
    shown, skip = [], False
    for arg in argv:
        if skip or arg == "--note":
            skip = not skip and arg == "--note"
            continue
        if not arg.startswith("--note="):
            shown.append(arg)
    return shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply (a)/(b)'s clips and (c)'s requests")
    parser.add_argument("--small-memory-limit", default=None,
                        help="(d)'s second Prism run: gateway.memory_limit_bytes (default: room for about "
                             f"{SMALL_BUDGET_CLIPS:g} clips' decodes beside the gateway's own memory)")
    parser.add_argument("--clip", default=None, metavar="WxH",
                        help="(a)/(b)'s clip size (default 640x360; a larger one costs a decode more, and more tokens)")
    parser.add_argument("--clip-max-pixels", type=int, default=None,
                        help="(a)/(b)'s mm_processor_kwargs.max_pixels (keeps a large clip within the model's context)")
    parser.add_argument("--note", default="", help="said in the measurements entry (the machine's state, the branch)")
    parser.add_argument("--no-record", action="store_true", help="leave docs/measurements/video-compare.md alone")
    args = parser.parse_args()
    ensure_demo_model(MODEL)
    sizes = Sizes().scaled(args.scale)
    if args.clip:
        width, height = (int(side) for side in args.clip.lower().split("x"))
        sizes = replace(sizes, clip=(width, height, *sizes.clip[2:]))
    sizes = replace(sizes, clip_max_pixels=args.clip_max_pixels)
    results: dict = {"sizes": sizes.__dict__}
    with tempfile.TemporaryDirectory(prefix="prism-video-compare-") as tmp:
        print("vLLM's own server:", flush=True)
        results["vllm"] = vllm(Path(tmp), sizes)
        print("Prism:", flush=True)
        results["prism"] = prism(Path(tmp) / "prism", sizes)
        small = args.small_memory_limit or small_memory_limit(results["prism"]["d"]["rss_before"], sizes)
        print(f"Prism, gateway.memory_limit_bytes {small}:", flush=True)
        results["prism_small"] = prism(Path(tmp) / "prism-small", sizes, small, with_scenarios=False)
    mismatches = prompt_token_mismatches(results)
    command = " ".join(["python -m bench.video_compare", *_options(sys.argv[1:])])
    text = markdown(results, sizes, command, mismatches)
    out_dir = REPO_ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "video-compare.json").write_text(json.dumps(results, indent=2, default=str))
    (out_dir / "video-compare.md").write_text(text)
    if not args.no_record:
        record(REPO_ROOT / "docs" / "measurements" / "video-compare.md", text, args.note)
    print(text)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
