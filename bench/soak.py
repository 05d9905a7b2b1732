"""Soak: mixed load for several minutes; resident memory of every process,
and, with --faults, a fault every minute and the requests it lost.

Bounded closed-loop load on loopback (images of mixed sizes, a share of them
repeated, streaming and not). After a warm-up, the RSS of the launcher
(gateway), the encoder, the engine and vLLM's processes is sampled; the
goal is flat within 10 % after warm-up.

With --faults the stack has two encoder and two engine replicas sharing a
Redis tier, and bench/faults.py kills or stops one thing every
--fault-every seconds (EngineCore killed, encoder killed, Redis restarted,
EngineCore stopped past the stall timeout). Every request is classified
ok / refused / cut / lost; the goal is 0 lost: no request that was admitted
and had no token yet may fail.

Run: .venv/bin/python -m bench.soak --minutes 5 [--faults]
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

from bench.faults import FaultSchedule, classify
from testing.redis_server import RedisServer
from testing.stack import LocalStack, free_port
from loadtest.synthetic import data_url, make_image

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
            fate = classify(httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120), body["stream"])
        except httpx.HTTPError as exc:
            fate = f"client error ({type(exc).__name__})"
        counts[fate] = counts.get(fate, 0) + 1
        if fate == "refused":
            time.sleep(0.5)  # as a client honouring Retry-After would, if less patiently


def processes(root: psutil.Process) -> dict[str, psutil.Process]:
    named = {"gateway": root}  # a multi-worker gateway's supervisor; one gateway is a child, below
    for child in root.children(recursive=True):
        cmd = " ".join(child.cmdline())
        if child.cmdline()[1:3] == ["-m", "gateway"]:  # not its video decoders ("-m gateway.intake…")
            named["gateway"] = child
        for key in ("vision_encoder", "llm_engine", "EngineCore", "Worker"):
            if key in cmd or key in child.name():
                named[key] = child
    return named


STALL_TIMEOUT_S = 5


def faulty_stack(run_dir: Path, redis: RedisServer) -> LocalStack:
    overrides = {
        "PRISM_ENCODER__SHARED_CACHE_URL": redis.url,
        "PRISM_ENCODER__SHARED_CACHE_RETRY_S": "2",
        "PRISM_ENGINE__STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
        "PRISM_ENGINE__STALL_RESTART_S": "60",
        "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "512",
        "PRISM_GATEWAY__STATS_INTERVAL_S": "0.5",
        "PRISM_GATEWAY__HEARTBEAT_TIMEOUT_S": "3",
    }
    return LocalStack(run_dir, overrides, encoder_replicas=2, engine_replicas=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--warmup", type=float, default=60, help="seconds excluded from the comparison")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--faults", action="store_true", help="two replicas of each service and a fault every --fault-every s")
    parser.add_argument("--fault-every", type=float, default=60)
    args = parser.parse_args()
    counts: dict = {}
    samples: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        redis = RedisServer(free_port()).start() if args.faults else None
        stack = faulty_stack(Path(run_dir), redis) if args.faults else LocalStack(Path(run_dir))
        try:
            with stack:
                faults = FaultSchedule(psutil.Process(stack.process.pid), redis, args.fault_every, STALL_TIMEOUT_S + 5) if args.faults else None
                sample_under_load(stack, args, counts, samples, faults)
        finally:
            if redis is not None:
                redis.stop()
    print(f"requests: {dict(counts)} over {args.minutes:g} min at concurrency {args.concurrency}")
    if faults is not None:
        print("faults:\n" + "\n".join(f"- {line}" for line in faults.log))
        print(f"lost (admitted, no token yet, failed): {counts.get('lost', 0)}")
    print("| process | RSS after warm-up | RSS at end | max | change |\n|---|---|---|---|---|")
    for key, values in samples.items():
        first, last, peak = values[0], values[-1], max(values)
        print(f"| {key} | {first / 2**20:.0f} MiB | {last / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | {100 * (last - first) / first:+.1f}% |")


def sample_under_load(stack: LocalStack, args, counts: dict, samples: dict, faults: FaultSchedule | None) -> None:
    stop = threading.Event()
    threads = [threading.Thread(target=worker, args=(stack.base_url, stop, counts, i)) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    if faults is not None:
        faults.start()
    started = time.monotonic()
    while time.monotonic() - started < args.minutes * 60:
        time.sleep(10)
        if time.monotonic() - started >= args.warmup and faults is None:  # with faults, processes come and go
            for key, process in processes(psutil.Process(stack.process.pid)).items():
                samples.setdefault(key, []).append(process.memory_info().rss)
    if faults is not None:
        faults.stop()
    stop.set()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
