"""Small images inside a mixed load: first come first served, size classes, and the express lane.

For each encoder batching setting, in turn, in one run: a stack on the
random-weights checkpoint with a 1 MP budget, then
1. 256² JPEGs sent alone, one at a time (the small image's own TTFT);
2. a closed loop at concurrency 8 of unique 256² and 4K JPEGs, half and half.
Prints, per setting, the 256² image's TTFT and `encode` inside the mix against
its TTFT alone (issue #18's bar: ≤ 1.5×), the 4K image's TTFT (what the
small ones' priority costs the large), the throughput, and where the 256²
image's time went (its stage medians).

With --rate, the load is bench.compare's instead, scenario (f): unique JPEGs
mixed evenly over 256², 720p, 1080p and 4K, arriving open loop (Poisson) at
RATE requests/s. One stack per --variant (environment overrides,
`K=V,K=V`; none: the shipped settings), in turn, alternated --rounds times;
each prints the 256² image's stages alone and in that load, p50 and p90, so
a small image's wait in the mix shows where it sits, the server's CPU seconds
per request (bench.compare's measure), and the same mix closed loop at
concurrency 8 (half as many requests).

Run: .venv/bin/python -m bench.small_images [--requests 48]
     .venv/bin/python -m bench.small_images --rate 2.65 --requests 160 [--variant K=V,K=V ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.compare import MIX, SMALL, measured
from loadtest.bench import Plan, load_test
from loadtest.client import Target
from loadtest.runner import Arrival
from loadtest.stats import SLO
from loadtest.workload import WorkloadSpec, parse_buckets
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import LocalStack

SETTINGS = {  # encoder.batch_size_ratio, encoder.express_max_patches
    "first come first served": ("0", "0"),
    "size classes (4x)": ("4", "0"),
    "size classes + express lane": ("4", "1024"),
}
MAX_PIXELS = 1024 * 1024


def small_alone(target: Target) -> dict:
    """Eight 256² images sent one at a time: the denominator of every ratio here."""
    return load_test(target, WorkloadSpec(SMALL, seed=1), Arrival(concurrency=1), Plan(requests=8, warmup=1, progress=False))


def run(setting: str, ratio: str, express: str, requests: int, run_dir: Path) -> dict:
    overrides = {"PRISM_ENCODER__BATCH_SIZE_RATIO": ratio, "PRISM_ENCODER__EXPRESS_MAX_PATCHES": express,
                 "PRISM_ENCODER__MAX_PIXELS": str(MAX_PIXELS)}
    with LocalStack(run_dir / setting.replace(" ", "-"), overrides, model=RANDOM_MODEL) as stack:
        target = Target(stack.base_url, "prism-demo")
        alone = small_alone(target)
        mixed = load_test(target, WorkloadSpec(parse_buckets("256x256=1,4k=1"), seed=2), Arrival(concurrency=8),
                          Plan(requests=requests, warmup=2, progress=False))
    small, large = mixed["by_bucket"]["256x256"], mixed["by_bucket"]["4k"]
    alone_ms = alone["summary"]["p50_ttft_ms"]
    stages = {f"256² {name} p50": row["p50"] for name, row in mixed["stage_percentiles"]["256x256"].items()}
    return {
        "256² alone TTFT p50": alone_ms,
        "256² in the mix TTFT p50": small["p50_ttft_ms"],
        "256² in the mix TTFT p90": small["p90_ttft_ms"],
        "256² in the mix / alone (p50)": small["p50_ttft_ms"] / alone_ms,
        "256² encode p50": mixed["stage_percentiles"]["256x256"]["encode"]["p50"],
        "4K TTFT p50": large["p50_ttft_ms"],
        "4K encode p50": mixed["stage_percentiles"]["4k"]["encode"]["p50"],
        "requests/s": mixed["summary"]["request_throughput"],
        **stages,
    }


def open_loop(variant: str, rate: float, requests: int, run_dir: Path) -> dict:
    """The 256² image alone, then inside bench.compare's mixed open loop."""
    overrides = {"PRISM_ENCODER__MAX_PIXELS": str(MAX_PIXELS),
                 **dict(pair.split("=", 1) for pair in variant.split(",") if pair)}
    with LocalStack(run_dir, overrides, model=RANDOM_MODEL) as stack:
        target = Target(stack.base_url, "prism-demo")
        alone = small_alone(target)
        mixed = measured(target, WorkloadSpec(MIX, seed=3), Arrival(rate=rate, seed=3), requests, SLO())
        closed = measured(target, WorkloadSpec(MIX, seed=4), Arrival(concurrency=8), requests // 2, SLO())
    small = mixed["by_bucket"]["256x256"]
    row = {"256² alone TTFT p50": alone["summary"]["p50_ttft_ms"],
           "256² in load TTFT p50 / p90": (small["p50_ttft_ms"], small["p90_ttft_ms"]),
           "256² in load / alone (p50)": small["p50_ttft_ms"] / alone["summary"]["p50_ttft_ms"],
           "256² requests in load": small["completed"],
           "all TTFT p50 / p90": (mixed["summary"]["p50_ttft_ms"], mixed["summary"]["p90_ttft_ms"]),
           "server CPU s per request": mixed["cpu_s_per_request"],
           "closed loop c=8: requests/s": closed["summary"]["request_throughput"],
           "closed loop c=8: server CPU s per request": closed["cpu_s_per_request"]}
    for stage, alone_row in alone["stage_percentiles"]["256x256"].items():
        loaded = mixed["stage_percentiles"]["256x256"][stage]
        row[f"256² {stage} p50 alone / load, p90 load"] = (alone_row["p50"], loaded["p50"], loaded["p90"])
    return row


def open_loop_rounds(variants: list[str], rounds: int, rate: float, requests: int, run_dir: Path) -> dict[str, dict]:
    """Each variant's stack in turn, `rounds` times (these machines drift)."""
    results = {}
    for i in range(rounds):
        for n, variant in enumerate(variants):
            name = f"{variant or 'shipped'} #{i + 1}"
            results[name] = open_loop(variant, rate, requests, run_dir / f"{i}-{n}")
            print(name, json.dumps(results[name]), file=sys.stderr, flush=True)  # kept if a later stack fails
    return results


def _cell(value) -> str:
    return " / ".join(f"{v:.1f}" for v in value) if isinstance(value, tuple) else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, help="bench.compare's mixed open loop at this many requests/s")
    parser.add_argument("--variant", action="append", help="with --rate: environment overrides K=V,K=V for one stack")
    parser.add_argument("--rounds", type=int, default=1, help="with --rate: run the variants in turn this many times")
    args = parser.parse_args()
    ensure_demo_model(RANDOM_MODEL)
    with tempfile.TemporaryDirectory() as run_dir:
        if args.rate:
            results = open_loop_rounds(args.variant or [""], args.rounds, args.rate, args.requests, Path(run_dir))
        else:
            results = {setting: run(setting, *values, args.requests, Path(run_dir)) for setting, values in SETTINGS.items()}
    print("| | " + " | ".join(results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for row in next(iter(results.values())):
        print(f"| {row} | " + " | ".join(_cell(r[row]) for r in results.values()) + " |")


if __name__ == "__main__":
    main()
