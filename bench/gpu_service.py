"""bench.gpu_encoder's service section: `python -m vision_encoder` on the GPU.

The encoder runs with configs/qwen2.5-vl-7b.yaml on the real-width
Qwen2.5-VL-7B tower, driven through the gateway's EncoderPool by
`concurrency` requests in flight, one unique image each (cache off), images
at the config's pixel budget as the gateway sends them. Each setting is one
encoder process, measured on 256² images and on 256² / 720p / 1080p / 4K
mixed; the settings differ only in the batching keys they set:

  batch-1        one image a batch, no pipelining (the baseline)
  cpu-policy     the CPU configs' rules: express lane for small images,
                 batches of alike sizes (size ratio 4), 5 ms wait
  gpu-wait-N     first come first served by patch budget, no express lane,
                 max_wait_ms N (-depth-1: the next batch formed only when the
                 ViT is free; -compiled: encoder.compile_blocks)
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import real_towers
from bench.encoder import Setting, drive, jobs_for, running
from common.config import REPO_ROOT
from gateway.routing.encoder_pool import EncoderPool
from gateway.intake.resize import smart_resize

CONFIG = REPO_ROOT / "configs" / "qwen2.5-vl-7b.yaml"
MIXES = {"256": [(256, 256)], "mixed": [(256, 256), (720, 1280), (1080, 1920), (2160, 3840)]}
GPU_POLICY = {"PRISM_ENCODER__EXPRESS_MAX_PATCHES": "0", "PRISM_ENCODER__BATCH_SIZE_RATIO": "0"}
SETTINGS = [  # most telling first: the budget may end the list
    Setting("batch-1", 1, {"PRISM_ENCODER__MAX_BATCH_IMAGES": "1", "PRISM_ENCODER__PIPELINE_DEPTH": "1",
                           "PRISM_ENCODER__MAX_WAIT_MS": "0", "PRISM_ENCODER__EXPRESS_MAX_PATCHES": "0"}),
    Setting("gpu-wait-5", 1, {**GPU_POLICY, "PRISM_ENCODER__MAX_WAIT_MS": "5"}),
    Setting("gpu-wait-5-depth-1", 1, {**GPU_POLICY, "PRISM_ENCODER__MAX_WAIT_MS": "5", "PRISM_ENCODER__PIPELINE_DEPTH": "1"}),
    Setting("gpu-wait-5-compiled", 1, {**GPU_POLICY, "PRISM_ENCODER__MAX_WAIT_MS": "5", "PRISM_ENCODER__COMPILE_BLOCKS": "true"}),
    Setting("gpu-wait-5-depth-1-compiled", 1, {**GPU_POLICY, "PRISM_ENCODER__MAX_WAIT_MS": "5", "PRISM_ENCODER__PIPELINE_DEPTH": "1",
                                               "PRISM_ENCODER__COMPILE_BLOCKS": "true"}),
    Setting("cpu-policy", 1, {"PRISM_ENCODER__EXPRESS_MAX_PATCHES": "1024", "PRISM_ENCODER__BATCH_SIZE_RATIO": "4",
                              "PRISM_ENCODER__MAX_WAIT_MS": "5"}),
    Setting("gpu-wait-0", 1, {**GPU_POLICY, "PRISM_ENCODER__MAX_WAIT_MS": "0"}),
    Setting("gpu-wait-2", 1, {**GPU_POLICY, "PRISM_ENCODER__MAX_WAIT_MS": "2"}),
    Setting("gpu-wait-10", 1, {**GPU_POLICY, "PRISM_ENCODER__MAX_WAIT_MS": "10"}),
]


def budget_images(sizes: list[tuple[int, int]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = {}
    for h, w in sizes:
        rh, rw = smart_resize(h, w, 28, real_towers.QWEN_MIN_PIXELS, real_towers.QWEN_MAX_PIXELS)
        images[f"{h}x{w}"] = rng.integers(0, 255, (rh, rw, 3), dtype=np.uint8)
    return images


def _totals(pool: EncoderPool) -> tuple[int, int]:
    return sum(r.stats.batches for r in pool.replicas), sum(r.stats.images_encoded for r in pool.replicas)


async def measure(setting: Setting, run_dir: Path, args, log, ready_timeout_s: float) -> None:
    started = time.monotonic()
    async with running(setting, run_dir, ready_timeout_s) as pool:
        ready_s = time.monotonic() - started
        for mix, sizes in MIXES.items():
            images = budget_images(sizes, seed=len(mix))
            await drive(pool, jobs_for(args.concurrency, images), args.concurrency)  # warm-up
            await asyncio.sleep(0.6)
            batches, encoded = _totals(pool)
            began = time.perf_counter()
            latencies = await drive(pool, jobs_for(args.requests, images), args.concurrency)
            elapsed = time.perf_counter() - began
            await asyncio.sleep(0.6)  # the last stats poll
            batches_after, encoded_after = _totals(pool)
            ordered = sorted(latencies)
            log(section="service", setting=setting.name, mix=mix, requests=args.requests, concurrency=args.concurrency,
                images_per_s=round(args.requests / elapsed, 1), p50_ms=round(statistics.median(latencies) * 1000, 1),
                p90_ms=round(ordered[int(0.9 * len(ordered))] * 1000, 1),
                mean_batch=round((encoded_after - encoded) / max(batches_after - batches, 1), 2), ready_s=round(ready_s, 1))


def run(args, budget, log) -> None:
    checkpoint = real_towers.ensure("qwen2.5-vl-7b", args.root, args.device, args.tiny)
    base = {"PRISM_CONFIG": str(CONFIG), "PRISM_MODEL": str(checkpoint), "PRISM_ENCODER__DEVICE": args.device,
            "PRISM_ENCODER__MAX_PIXELS": str(real_towers.QWEN_MAX_PIXELS),
            "PRISM_ENCODER__GPU_MEMORY_FRACTION": "null",  # alone on the GPU here: no engine beside it
            # as shipped (the config's graph_max_patches), eager but for the -compiled settings
            "PRISM_ENCODER__COMPILE_BLOCKS": "false"}
    with tempfile.TemporaryDirectory(prefix="prism-gpu-service-") as tmp:
        chosen = set(filter(None, args.service_settings.split(",")))
        for setting in SETTINGS:
            if chosen and setting.name not in chosen:
                continue
            if budget.left() < 75:  # a setting takes 50-75 s: start one only if it can end
                log(section="service", setting=setting.name, skipped=f"{budget.left():.0f} s left")
                continue
            configured = Setting(setting.name, setting.replicas, {**base, **setting.env})
            try:
                asyncio.run(measure(configured, Path(tmp), args, log, ready_timeout_s=min(300, budget.left())))
            except Exception as exc:
                log(section="service", setting=setting.name, error=repr(exc)[:300])
                keep_log_tail(Path(tmp), setting.name)


def keep_log_tail(run_dir: Path, name: str) -> None:
    """The failed encoder's last lines, into one file under $OUT (few files come back from the device)."""
    out = Path(os.environ.get("OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    for logfile in run_dir.glob(f"{name}*.log"):
        with open(out / "encoder-errors.txt", "ab") as errors:
            errors.write(f"==== {logfile.name}\n".encode() + logfile.read_bytes()[-6000:])
