"""Where a running stack spends its CPU: py-spy on every Prism process during a workload.

Starts the stack (the trained demo model by default), then, while a workload of
unique JPEGs runs through the official `openai` client, records each process
with py-spy (sampling, non-blocking): the gateway, the vision encoder, the
engine service, vLLM's engine core and its worker (where the model runs on a CPU).
Prints each process's CPU seconds per
request (from /proc), its busiest threads' CPU, system time and page faults
per request, and its hottest functions by own samples and by Prism frames;
keeps py-spy's raw stacks (flamegraph.pl or speedscope read them) in --out.
docs/profiling.md says how to read them.

With `--workload video-mix`, the workload is bench.video_compare's (c)
instead: 256² and 720p images and 4 s / 10 s clips, half the clips repeats
(its checkpoint and budget: pass them as below).

Run: .venv/bin/python -m bench.profile --resolution 3840x2160 --requests 24
     .venv/bin/python -m bench.profile --concurrency 8 --out /tmp/profile
     .venv/bin/python -m bench.profile --model models/prism-demo-qwen2vl --max-pixels 1048576 --concurrency 8
       (bench.compare's checkpoint and budget)
     .venv/bin/python -m bench.profile --workload video-mix --model models/prism-demo-qwen2vl --max-pixels 1048576 \
       --requests 128 --concurrency 8   (bench.video_compare's (c))
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from openai import OpenAI

from loadtest.client import Target
from loadtest.synthetic import data_url, make_image
from prism.demo_model import SHAPES_MODEL
from testing.stack import LocalStack

PRISM_PACKAGES = ("gateway/", "vision_encoder/", "llm_engine/", "protocol/", "cache/")
TICKS = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process below `root` (gone ones skipped)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == root:
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if _descends_from(int(entry.name), root):
                yield int(entry.name), command
        except (OSError, ValueError):
            continue  # gone meanwhile


def service_pids(stack: LocalStack) -> dict[str, int]:
    """Process name → pid, found by their command line."""
    found = {}
    # "-m gateway " (each argument ends in a NUL, read as a space): not its video decoders' "-m gateway.intake…"
    wanted = {"-m gateway ": "gateway", "-m vision_encoder": "encoder", "-m llm_engine": "engine", "VLLM::EngineCore": "engine_core", "VLLM::Worker": "engine_worker"}
    for pid, command in descendants(stack.process.pid):
        for needle, name in wanted.items():
            if needle in command:
                found.setdefault(name, pid)
    return found


def _stat(pid: int) -> list[str]:
    return _stat_of(Path(f"/proc/{pid}/stat"))


def _stat_of(path: Path) -> list[str]:
    return path.read_text().rsplit(")", 1)[1].split()  # the fields after the command name


def _descends_from(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        pid = int(_stat(pid)[1])  # the parent
    return False


def cpu_seconds(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def thread_counters(pid: int) -> dict[int, tuple[float, float, int]]:
    """Thread id → (user s, system s, minor page faults) so far. py-spy counts a thread waiting for a core as busy and
    cannot tell time in the kernel (page faults above all) from its frame's own work: these go beside its samples."""
    counters = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = _stat_of(task / "stat")
        except OSError:
            continue  # gone meanwhile
        counters[int(task.name)] = (int(fields[11]) / TICKS, int(fields[12]) / TICKS, int(fields[7]))
    return counters


def thread_names(py_spy: str, pid: int) -> dict[int, str]:
    """Thread id → its Python name (py-spy dump's "Thread 123 (idle): "vit_0""); threads outside Python have none."""
    dump = subprocess.run([py_spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    return {int(tid): name for tid, name in re.findall(r'^Thread (\d+) \([^)]*\): "([^"]*)"', dump, re.MULTILINE)}


def workload(base_url: str, resolution: tuple[int, int], requests: int, concurrency: int, model: str) -> float:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    images = [data_url(make_image(f"profile-{i}", resolution), "JPEG") for i in range(requests)]

    def one(url: str) -> None:
        stream = client.chat.completions.create(
            model=model, max_tokens=8, temperature=0, stream=True,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "Describe the image."}]}],
        )
        for _ in stream:
            pass

    one(data_url(make_image("profile-warm-up", resolution), "JPEG"))
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, images))
    return time.perf_counter() - started


def video_mix(base_url: str, requests: int, concurrency: int) -> float:
    """bench.video_compare's (c) in a closed loop at `concurrency` (its warm-up first, as `workload`'s); its wall time."""
    from bench import video_compare

    sizes = replace(video_compare.Sizes(), mixed_requests=requests, mixed_in_flight=concurrency)
    report = video_compare.mixed(Target(base_url, video_compare.SERVED_NAME), sizes)
    return requests / report["summary"]["request_throughput"]


def _thread_lines(after: dict[int, tuple[float, float, int]], before: dict[int, tuple[float, float, int]],
                  names: dict[int, str], requests: int, top: int = 4) -> list[str]:
    """A process's busiest threads over the workload: CPU (user, system) and minor page faults per request."""
    spent = {tid: tuple(now - then for now, then in zip(counters, before.get(tid, (0.0, 0.0, 0))))
             for tid, counters in after.items()}
    busiest = sorted(spent.items(), key=lambda item: -(item[1][0] + item[1][1]))[:top]
    return [f"{names.get(tid, f'thread {tid}'):<24} {(user + system) / requests * 1000:6.1f} ms CPU "
            f"(system {system / requests * 1000:.1f}), {faults / requests:.0f} page faults"
            for tid, (user, system, faults) in busiest]


def hottest(raw: Path, top: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
    """(own samples per frame, inclusive samples per Prism frame, total samples) from py-spy's raw stacks."""
    own, prism_frames, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, samples = stack.split(";"), int(count)
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            if any(package in frame for package in PRISM_PACKAGES):
                prism_frames[frame] += samples
    return own.most_common(top), prism_frames.most_common(top), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SHAPES_MODEL)
    parser.add_argument("--max-pixels", type=int, help="the encoder's pixel budget (default: the checkpoint's)")
    parser.add_argument("--workload", choices=("jpeg", "video-mix"), default="jpeg",
                        help="unique JPEGs of --resolution, or bench.video_compare's (c)")
    parser.add_argument("--resolution", default="3840x2160")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path, help="keep the raw stacks here (default: a temporary directory)")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        raise SystemExit("py-spy is not installed: make install (it is in the lock file)")
    width, height = map(int, args.resolution.split("x"))
    with tempfile.TemporaryDirectory() as run_dir:
        out = args.out or Path(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        overrides = {"PRISM_ENCODER__MAX_PIXELS": str(args.max_pixels)} if args.max_pixels else {}
        with LocalStack(Path(run_dir), overrides, model=args.model) as stack:
            pids = service_pids(stack)
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            threads_before = {name: thread_counters(pid) for name, pid in pids.items()}
            recorders = {
                name: subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--nonblocking",
                                        "--format", "raw", "--output", str(out / f"{name}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for name, pid in pids.items()
            }
            time.sleep(1)  # py-spy attaches
            if args.workload == "video-mix":
                wall = video_mix(stack.base_url, args.requests, args.concurrency)
            else:
                wall = workload(stack.base_url, (width, height), args.requests, args.concurrency, "prism-demo")
            cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            threads_after = {name: thread_counters(pid) for name, pid in pids.items()}
            for recorder in recorders.values():
                recorder.send_signal(signal.SIGINT)
                recorder.wait(30)
            threads = {name: _thread_lines(threads_after[name], threads_before[name], thread_names(py_spy, pid), args.requests)
                       for name, pid in pids.items()}
        what = "of bench.video_compare's (c)" if args.workload == "video-mix" else f"of {args.resolution} JPEG"
        print(f"{args.requests} requests {what} at concurrency {args.concurrency}: "
              f"{wall:.1f} s, {args.requests / wall:.2f} requests/s")
        for name in pids:
            print(f"\n## {name}: {cpu[name] / args.requests * 1000:.0f} ms CPU per request (all its threads, /proc)")
            print("busiest threads, per request (/proc):")
            for line in threads[name]:
                print(f"  {line}")
            if not (out / f"{name}.txt").exists():
                print("(py-spy wrote nothing)")
                continue
            own, prism_frames, total = hottest(out / f"{name}.txt", args.top)
            print(f"own samples (of {total}):")
            for frame, samples in own:
                print(f"  {samples / total:6.1%}  {frame}")
            print("Prism frames, inclusive:")
            for frame, samples in prism_frames:
                print(f"  {samples / total:6.1%}  {frame}")


if __name__ == "__main__":
    main()
