"""Gateway workers: what one gateway process sustains, and what a second adds.

Starts the stack (`prism serve`, the demo config and trained model, as
`make serve` does) with
`gateway.workers` 1, then 2, and sends each the same kind of load: unique
JPEGs (4K by default) as data: URLs, one per request, 4 output tokens, at a
fixed concurrency, each request on a new connection (as many clients would;
the kernel spreads connections over the workers). Client bodies are encoded
before the clock starts, so the client spends little CPU beside the stack.

For each setting it prints requests/s, TTFT p50/p90 (from the response's
stage breakdown), and CPU seconds per request of the gateway's processes, the
encoder's and the engine's (all their threads, from /proc). The gateway's CPU
per request gives the ceiling of one gateway process: 1 / that, in requests/s
per core it has to itself.

Run: .venv/bin/python -m bench.gateway_workers [--requests 96] [--concurrency 8] [--resolution 3840x2160]
     .venv/bin/python -m bench.gateway_workers --workers 1 2 1 2   (alternating runs: these machines are noisy)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.profile import cpu_seconds, descendants
from prism.demo_model import SHAPES_MODEL
from testing.stack import LocalStack
from loadtest.synthetic import data_url, make_image

ROLES = (("-m gateway", "gateway"), ("-m vision_encoder", "encoder"), ("-m llm_engine", "engine"), ("VLLM::", "engine"))


def stack_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far of the stack's processes, by role; the launcher counts as the gateway (it supervises it)."""
    totals = {"gateway": cpu_seconds(root), "encoder": 0.0, "engine": 0.0}
    for pid, command in descendants(root):
        role = next((name for needle, name in ROLES if needle in command), None)
        if role is not None:
            with contextlib.suppress(OSError):  # gone meanwhile
                totals[role] += cpu_seconds(pid)
    return totals


def bodies(count: int, resolution: tuple[int, int], tag: str) -> list[bytes]:
    def body(i: int) -> bytes:
        url = data_url(make_image(f"workers-{tag}-{i}", resolution), "JPEG")
        return json.dumps({"model": "prism-demo", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]}]}).encode()
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(body, range(count)))


def drive(base_url: str, payloads: list[bytes], concurrency: int) -> tuple[float, list[float]]:
    def one(payload: bytes) -> float:
        response = httpx.post(f"{base_url}/v1/chat/completions", content=payload, timeout=300,
                              headers={"content-type": "application/json"})
        response.raise_for_status()
        return response.json()["prism"]["stages_ms"]["ttft"]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        ttfts = list(pool.map(one, payloads))
    return time.perf_counter() - started, ttfts


def measure(workers: int, requests: int, concurrency: int, resolution: tuple[int, int], run_dir: Path) -> dict:
    warm, payloads = bodies(concurrency, resolution, f"warm-{workers}"), bodies(requests, resolution, f"w{workers}")
    with LocalStack(run_dir / f"workers-{workers}", {"PRISM_GATEWAY__WORKERS": str(workers)}, model=SHAPES_MODEL) as stack:
        drive(stack.base_url, warm, concurrency)
        before = stack_cpu(stack.process.pid)
        wall, ttfts = drive(stack.base_url, payloads, concurrency)
        after = stack_cpu(stack.process.pid)
    cpu = {role: (after[role] - before[role]) / requests * 1000 for role in after}
    ordered = sorted(ttfts)
    return {"workers": workers, "rps": requests / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p90": ordered[int(0.9 * (len(ordered) - 1))], "cpu_ms": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--resolution", default="3840x2160")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    resolution = tuple(map(int, args.resolution.split("x")))
    with tempfile.TemporaryDirectory() as run_dir:
        results = [measure(w, args.requests, args.concurrency, resolution, Path(run_dir)) for w in args.workers]
    print(f"{args.requests} unique {args.resolution} JPEGs, concurrency {args.concurrency}, demo model and config\n")
    print("| gateway workers | requests/s | TTFT p50 ms | TTFT p90 ms | gateway CPU ms/req | encoder | engine | one gateway process's ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        cpu = r["cpu_ms"]
        print(f"| {r['workers']} | {r['rps']:.1f} | {r['ttft_p50']:.0f} | {r['ttft_p90']:.0f} | {cpu['gateway']:.1f} | "
              f"{cpu['encoder']:.1f} | {cpu['engine']:.1f} | {1000 / cpu['gateway']:.0f} req/s per core |")
    by_count: dict[int, list[float]] = {}
    for r in results:
        by_count.setdefault(r["workers"], []).append(r["rps"])
    means = {count: statistics.mean(values) for count, values in by_count.items()}
    fewest = min(means)
    for count, mean in sorted(means.items()):
        print(f"\n{count} worker(s): {mean:.1f} requests/s over {len(by_count[count])} run(s), "
              f"{mean / means[fewest]:.2f}x {fewest} worker(s)")

if __name__ == "__main__":
    main()
