"""Small images inside a mixed load: first come first served, size classes, and the express lane.

For each encoder batching setting, in turn, in one run: a stack on the
random-weights checkpoint with a 1 MP budget, then
1. 256² JPEGs sent alone, one at a time (the small image's own TTFT);
2. a closed loop at concurrency 8 of unique 256² and 4K JPEGs, half and half.
Prints, per setting, the 256² image's TTFT and `encode` inside the mix against
its TTFT alone (issue #18's bar: ≤ 1.5×), the 4K image's TTFT (what the
small ones' priority costs the large), the throughput, and where the 256²
image's time went (its stage medians).

Run: .venv/bin/python -m bench.small_images [--requests 48]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from loadtest.bench import Plan, load_test
from loadtest.client import Target
from loadtest.runner import Arrival
from loadtest.workload import WorkloadSpec, parse_buckets
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.stack import LocalStack

SETTINGS = {  # encoder.batch_size_ratio, encoder.express_max_patches
    "first come first served": ("0", "0"),
    "size classes (4x)": ("4", "0"),
    "size classes + express lane": ("4", "1024"),
}
MAX_PIXELS = 1024 * 1024


def run(setting: str, ratio: str, express: str, requests: int, run_dir: Path) -> dict:
    overrides = {"PRISM_ENCODER__BATCH_SIZE_RATIO": ratio, "PRISM_ENCODER__EXPRESS_MAX_PATCHES": express,
                 "PRISM_ENCODER__MAX_PIXELS": str(MAX_PIXELS)}
    with LocalStack(run_dir / setting.replace(" ", "-"), overrides, model=RANDOM_MODEL) as stack:
        target = Target(stack.base_url, "prism-demo")
        alone = load_test(target, WorkloadSpec(parse_buckets("256x256=1"), seed=1), Arrival(concurrency=1),
                          Plan(requests=8, warmup=1, progress=False))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args()
    ensure_demo_model(RANDOM_MODEL)
    with tempfile.TemporaryDirectory() as run_dir:
        results = {setting: run(setting, *values, args.requests, Path(run_dir)) for setting, values in SETTINGS.items()}
    print("| | " + " | ".join(results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for row in next(iter(results.values())):
        print(f"| {row} | " + " | ".join(f"{r[row]:.2f}" for r in results.values()) + " |")


if __name__ == "__main__":
    main()
