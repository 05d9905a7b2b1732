"""Vision-encoder throughput: batching, pipelining and replicas, side by side.

Encoder processes alone (no engine, no gateway), driven through the gateway's
own EncoderPool at a fixed concurrency with unique images (every one a cache
miss), resolutions mixed evenly over 256², 720p, 1080p and 4K and downscaled
to the encoder's pixel budget as the gateway would. Each setting runs in turn
in one invocation, on the same requests:

  batch-1        max_batch_images 1, pipeline_depth 1 (the baseline)
  batched        max_batch_images 16, pipeline_depth 1
  batched+pipe   max_batch_images 16, pipeline_depth 2 (the default)
  1 replica, 2 threads   the default with torch_threads 2 (one process, both cores)
  2 replicas     two batched+pipe encoders behind the pool (1 thread each)

Then 16 concurrent requests for one new image: the number of encodes.

Run: .venv/bin/python -m bench.encoder [--requests 64] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq.asyncio

from gateway.routing.encoder_pool import EncoderPool
from gateway.intake.resize import resize_pixels, smart_resize
from loadtest.workload import RESOLUTIONS
from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from loadtest.synthetic import make_image
from protocol.tensors import to_frame
from protocol.to_encoder import ImageInput

MODEL = RANDOM_MODEL
MIX = {name: RESOLUTIONS[name] for name in ("256x256", "720p", "1080p", "4k")}  # the load tester's names
MAX_PIXELS = 1024 * 1024


@dataclass(frozen=True)
class Setting:
    name: str
    replicas: int
    env: dict[str, str]


SETTINGS = [
    Setting("batch-1", 1, {"PRISM_ENCODER__MAX_BATCH_IMAGES": "1", "PRISM_ENCODER__PIPELINE_DEPTH": "1"}),
    Setting("batched", 1, {"PRISM_ENCODER__MAX_BATCH_IMAGES": "16", "PRISM_ENCODER__PIPELINE_DEPTH": "1"}),
    Setting("batched+pipe", 1, {"PRISM_ENCODER__MAX_BATCH_IMAGES": "16", "PRISM_ENCODER__PIPELINE_DEPTH": "2"}),
    Setting("1 replica, 2 threads", 1, {"PRISM_ENCODER__TORCH_THREADS": "2"}),
    Setting("2 replicas", 2, {"PRISM_ENCODER__MAX_BATCH_IMAGES": "16", "PRISM_ENCODER__PIPELINE_DEPTH": "2"}),
]


def budget_pixels() -> dict[str, np.ndarray]:
    """One decoded image per resolution, resized to the budget (the gateway's job)."""
    out = {}
    for name, (w, h) in MIX.items():
        rh, rw = smart_resize(h, w, 28, 56 * 56, MAX_PIXELS)
        out[name] = resize_pixels(make_image(name, (w, h)), rw, rh)
    return out


class Encoders:
    """N encoder processes on ipc sockets in a temporary directory."""

    def __init__(self, run_dir: Path, setting: Setting) -> None:
        self.addresses = [f"ipc://{run_dir}/{setting.name.replace(' ', '-')}-{i}.sock" for i in range(setting.replicas)]
        env = {**os.environ, "PRISM_ENCODER__MAX_PIXELS": str(MAX_PIXELS), "PRISM_ENCODER__CACHE_CAPACITY_MB": "0", **setting.env}
        self.log_path = run_dir / f"{setting.name.replace(' ', '-')}.log"
        log = open(self.log_path, "wb")
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "vision_encoder"], cwd=REPO_ROOT, env={**env, "PRISM_ENCODER__ADDRESS": a},
                             stdout=log, stderr=subprocess.STDOUT)
            for a in self.addresses
        ]

    async def until_ready(self, connecting) -> None:
        """`connecting` awaited, but an encoder that exits first (a config error, a failed capture)
        ends the wait at once: its log says why."""
        connected = asyncio.ensure_future(connecting)
        while not connected.done():
            if exited := [p.returncode for p in self.processes if p.poll() is not None]:
                connected.cancel()
                raise RuntimeError(f"an encoder exited with code {exited[0]} before it answered (its log: {self.log_path})")
            await asyncio.wait({connected}, timeout=1)
        connected.result()

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
            process.wait(30)


async def drive(pool: EncoderPool, jobs: list[tuple[bytes, np.ndarray]], concurrency: int) -> list[float]:
    """Closed loop: `concurrency` requests in flight; each request's latency."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    latencies: list[float] = []

    async def worker() -> None:
        while not queue.empty():
            digest, pixels = queue.get_nowait()
            meta, frame = to_frame(pixels)
            started = time.perf_counter()
            with pool.route([digest]) as route:
                await pool.encode(route, uuid.uuid4().hex, [ImageInput(digest, meta)], [frame], 300)
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def jobs_for(count: int, images: dict[str, np.ndarray]) -> list[tuple[bytes, np.ndarray]]:
    names = list(images)
    return [(os.urandom(16), images[names[i % len(names)]]) for i in range(count)]


async def images_encoded(pool: EncoderPool) -> int:
    await asyncio.sleep(0.6)  # one more stats poll
    return sum(r.stats.images_encoded for r in pool.replicas)


@asynccontextmanager
async def running(setting: Setting, run_dir: Path, ready_timeout_s: float = 180):
    """The setting's encoders started, and the gateway's pool over them once every one answers."""
    encoders = Encoders(run_dir, setting)
    ctx = zmq.asyncio.Context()
    pool = EncoderPool(ctx, encoders.addresses, heartbeat_timeout_s=max(30, ready_timeout_s / 2))
    try:
        await encoders.until_ready(pool.connect(ready_timeout_s))
        pool.start_heartbeat(0.25)
        yield pool
    finally:
        await pool.close()
        ctx.term()
        encoders.stop()


async def measure(setting: Setting, run_dir: Path, images, requests: int, concurrency: int) -> dict:
    async with running(setting, run_dir) as pool:
        await drive(pool, jobs_for(len(images) * 2, images), concurrency)  # warm-up
        started = time.perf_counter()
        latencies = await drive(pool, jobs_for(requests, images), concurrency)
        elapsed = time.perf_counter() - started
        result = {
            "setting": setting.name, "images": requests, "seconds": round(elapsed, 2),
            "images_per_s": round(requests / elapsed, 2), "p50_ms": round(statistics.median(latencies) * 1000),
            "mean_batch": _mean_batch(pool),
        }
        if setting.name == "2 replicas":
            before = await images_encoded(pool)
            digest = os.urandom(16)
            await drive(pool, [(digest, images["1080p"])] * 16, 16)
            result["same_image_x16_encodes"] = await images_encoded(pool) - before
            result["requests_per_replica"] = list(pool.requests_sent)
        return result


def _mean_batch(pool: EncoderPool) -> float:
    batches = sum(r.stats.batches for r in pool.replicas)
    return round(sum(r.stats.images_encoded for r in pool.replicas) / max(batches, 1), 2)


def table(results: list[dict]) -> str:
    base = results[0]["images_per_s"]
    lines = ["| setting | images/s | vs batch-1 | p50 latency | mean images per batch |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['setting']} | {r['images_per_s']:.2f} | {r['images_per_s'] / base:.2f}× | {r['p50_ms']} ms | {r['mean_batch']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "encoder.json")
    args = parser.parse_args()
    ensure_demo_model(MODEL)
    images = budget_pixels()
    results = []
    with tempfile.TemporaryDirectory(prefix="prism-bench-encoder-") as tmp:
        for setting in SETTINGS:
            results.append(asyncio.run(measure(setting, Path(tmp), images, args.requests, args.concurrency)))
            print(json.dumps(results[-1]), flush=True)
    print()
    print(table(results))
    same = results[-1]
    print(f"\n16 concurrent requests for one new 1080p image over 2 replicas: {same['same_image_x16_encodes']} encode(s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
