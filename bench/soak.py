"""Soak: mixed load for several minutes; resident memory of every process.

Bounded closed-loop load on loopback (images of mixed sizes, a share of them
repeated, streaming and not). After a warm-up, the RSS of the launcher
(gateway), the encoder, the engine and vLLM's processes is sampled; the
goal is flat within 10 % after warm-up.

Run: .venv/bin/python -m bench.soak --minutes 5
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from prism.stack import LocalStack
from prism.synthetic import data_url, make_image

SIZES = [(256, 256), (1280, 720), (1920, 1080), (640, 480)]


def worker(base_url: str, stop: threading.Event, counts: dict, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        repeat = rng.random() < 0.5
        size = rng.choice(SIZES)
        name = f"soak-{size}-{rng.randrange(4) if repeat else rng.randrange(10**9)}"
        url = data_url(make_image(name, size))
        body = {"model": "prism-demo", "max_tokens": 16, "stream": rng.random() < 0.5,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]}]}
        try:
            status = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).status_code
        except httpx.HTTPError:
            status = "error"
        counts[status] = counts.get(status, 0) + 1


def processes(root: psutil.Process) -> dict[str, psutil.Process]:
    named = {"gateway": root}
    for child in root.children(recursive=True):
        cmd = " ".join(child.cmdline())
        for key in ("vision_encoder", "llm_engine", "EngineCore", "Worker"):
            if key in cmd or key in child.name():
                named[key] = child
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--warmup", type=float, default=60, help="seconds excluded from the comparison")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    counts: dict = {}
    samples: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as run_dir, LocalStack(Path(run_dir)) as stack:
        stop = threading.Event()
        threads = [threading.Thread(target=worker, args=(stack.base_url, stop, counts, i)) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        started = time.monotonic()
        named = processes(psutil.Process(stack.process.pid))
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(10)
            if time.monotonic() - started >= args.warmup:
                for key, process in named.items():
                    samples.setdefault(key, []).append(process.memory_info().rss)
        stop.set()
        for t in threads:
            t.join()
    print(f"requests: {dict(counts)} over {args.minutes:g} min at concurrency {args.concurrency}")
    print("| process | RSS after warm-up | RSS at end | max | change |\n|---|---|---|---|---|")
    for key, values in samples.items():
        first, last, peak = values[0], values[-1], max(values)
        print(f"| {key} | {first / 2**20:.0f} MiB | {last / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | {100 * (last - first) / first:+.1f}% |")


if __name__ == "__main__":
    main()
