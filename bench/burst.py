"""Bursts of large uploads at a gateway held to its container's memory limit.

The gateway runs alone in a memory cgroup of its own (bench/cgroup.py) with
the limit its Kubernetes Deployment declares (deploy/kubernetes/base/
gateway.yaml), beside an encoder and an engine started separately, as
docs/operations.md, "Running the services separately", shows. Then bursts
of unique 4K JPEG uploads (bench/uploads.py), all at once, and a burst of slow uploads. For each burst:
the answers by status (a failed request by its error), the time until the
last answer (drain), the gateway's peak RSS (the kernel's high-water mark,
reset before each burst) and the cgroup's peak usage against the limit, the
RSS 10 s after the burst, OOM kills, the peak of the kernel's buffers of the
gateway's sockets (under cgroup v1, which does not charge them to the limit;
v2 does: bench/cgroup.py), and the encoder's and engine's peak RSS
(each summed over its process tree). A killed gateway is started again for
the next burst.

Goals (issue 48): alive, peak RSS <= 0.85 x the limit, every answer 200 or
429/503 with Retry-After, no connection reset.

Logs go to bench/results/burst-<time>/. Run as root (the cgroup):
.venv/bin/python -m bench.burst [--bursts 100,300,1000] [--slow 200] [--config configs/compose.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import yaml
from pydantic import ByteSize, TypeAdapter

from bench.cgroup import MemoryCgroup
from bench.uploads import Uploads, burst, by_outcome, large_jpeg
from common.config import DEFAULT_CONFIG, REPO_ROOT
from prism.launch import ENCODER_TUNABLES, ENGINE_TUNABLES
from testing.stack import free_port, scrape, wait_for_health

MIB = 2**20
GATEWAY_MANIFEST = REPO_ROOT / "deploy" / "kubernetes" / "base" / "gateway.yaml"


def manifest_limit() -> int:
    """The gateway container's memory limit, a Kubernetes quantity ("2Gi") in bytes."""
    deployment = next(d for d in yaml.safe_load_all(GATEWAY_MANIFEST.read_text()) if d["kind"] == "Deployment")
    quantity = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    return TypeAdapter(ByteSize).validate_python(f"{quantity}B")  # 2Gi → 2GiB, pydantic's spelling


def rss(pid: int, field: str = "VmRSS") -> int:
    """VmRSS, or VmHWM: the peak since the last `reset_peak_rss`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM (proc(5))


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


class Services:
    """Encoder and engine on their own; the gateway in the cgroup, restartable."""

    def __init__(self, run_dir: Path, config: Path, cgroup: MemoryCgroup, overrides: dict[str, str]) -> None:
        self.run_dir, self.config, self.cgroup = run_dir, config, cgroup
        self.port = free_port()
        encoder, engine = f"ipc://{run_dir}/encoder.sock", f"ipc://{run_dir}/engine.sock"
        self.env = {**os.environ, "PRISM_CONFIG": str(config), "PRISM_ENCODER__ADDRESS": encoder,
                    "PRISM_ENGINE__ADDRESS": engine, "PRISM_GATEWAY__ENCODER_ADDRESSES": f"[{encoder}]",
                    "PRISM_GATEWAY__ENGINE_ADDRESSES": f"[{engine}]", "PRISM_GATEWAY__PORT": str(self.port),
                    "PRISM_GATEWAY__HOST": "127.0.0.1", "PRISM_ENCODER__SHARED_CACHE_URL": "null",
                    "PRISM_ENGINE__SHARED_CACHE_URL": "null", **overrides}
        self.log = open(run_dir / "services.log", "ab")
        self.processes: dict[str, subprocess.Popen] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, module: str, env: dict[str, str] | None = None, preexec=None) -> subprocess.Popen:
        self.processes[module] = subprocess.Popen(
            [sys.executable, "-m", module], cwd=REPO_ROOT, env={**self.env, **(env or {})}, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)
        return self.processes[module]

    def start_all(self) -> None:
        self.start("vision_encoder", {"GLIBC_TUNABLES": ENCODER_TUNABLES})
        self.start("llm_engine", {"GLIBC_TUNABLES": ENGINE_TUNABLES})
        self.start_gateway()

    def start_gateway(self) -> None:
        process = self.start("gateway", preexec=self.cgroup.enter)  # under the limit from its first byte
        wait_for_health(self.base_url, process, timeout_s=600)

    @property
    def gateway(self) -> subprocess.Popen:
        return self.processes["gateway"]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


class PeakSampler:
    """The encoder's and engine's RSS (process trees), sampled every 0.2 s."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.peaks = {"vision_encoder": 0, "llm_engine": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for module in self.peaks:
                self.peaks[module] = max(self.peaks[module], tree_rss(self.services.processes[module].pid))

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def one_burst(services: Services, uploads: Uploads, label: str, count: int, first: int,
              bytes_per_s: float | None, settle_s: float) -> dict:
    pid = services.gateway.pid
    reset_peak_rss(pid)
    services.cgroup.reset_peak()
    kills = services.cgroup.oom_kills
    before = rss(pid)
    started = time.perf_counter()
    with PeakSampler(services) as sampler:
        answers = asyncio.run(burst(services.base_url, uploads, count, first, bytes_per_s))
    drain_s = time.perf_counter() - started
    alive = services.gateway.poll() is None
    peak = rss(pid, "VmHWM") if alive else None
    time.sleep(settle_s if alive else 0)
    row = {"burst": label, "count": count, "answers": by_outcome(answers), "drain_s": round(drain_s, 1),
           "alive": alive, "oom_kills": services.cgroup.oom_kills - kills, "rss_before": before, "peak_rss": peak,
           "cgroup_peak": services.cgroup.peak, "socket_peak": services.cgroup.socket_peak, "rss_after": rss(pid) if alive else None,
           "encoder_peak": sampler.peaks["vision_encoder"], "engine_peak": sampler.peaks["llm_engine"]}
    print(json.dumps(row), flush=True)
    if not alive:
        services.start_gateway()
    return row


def mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:,.0f} MiB"


def table(rows: list[dict], limit: int) -> str:
    lines = ["| burst | answers | drain | gateway peak RSS (× limit) | cgroup peak | socket buffers' peak (v1) | "
             "RSS before → 10 s after | encoder / engine peak RSS |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        answers = ", ".join(f"{n} × {what}" for what, n in r["answers"].items())
        peak = "killed" if r["peak_rss"] is None else f"{mib(r['peak_rss'])} ({r['peak_rss'] / limit:.2f})"
        lines.append(f"| {r['burst']} | {answers} | {r['drain_s']} s | {peak} | {mib(r['cgroup_peak'])} | {mib(r['socket_peak'])} | "
                     f"{mib(r['rss_before'])} → {mib(r['rss_after'])} | {mib(r['encoder_peak'])} / {mib(r['engine_peak'])} |")
    return "\n".join(lines)


def run(args, limit: int, uploads: Uploads, run_dir: Path) -> list[dict]:
    cgroup = MemoryCgroup(f"prism-burst-{os.getpid()}", limit)
    services = Services(run_dir, args.config, cgroup, dict(item.split("=", 1) for item in args.set))
    try:
        services.start_all()
        budget = {name: value for (name, _), value in scrape(services.base_url).items() if name.startswith("prism_gateway_memory")}
        print(f"the gateway's memory budget: {budget or 'none'}")
        one_burst(services, uploads, "warm-up", 8, 10**6, None, args.settle_s)
        rows, first = [], 0
        for count in map(int, args.bursts.split(",")):
            rows.append(one_burst(services, uploads, f"{count} at once", count, first, None, args.settle_s))
            first += count
        if args.slow:
            label = f"{args.slow} slow ({args.slow_rate_kib:g} KiB/s each)"
            rows.append(one_burst(services, uploads, label, args.slow, first, args.slow_rate_kib * 1024, args.settle_s))
        return rows
    finally:
        services.stop()
        cgroup.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, default=None, help="the cgroup's limit (default: the manifest's)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--bursts", default="100,300,1000", help="sizes of the bursts of uploads at full speed")
    parser.add_argument("--slow", type=int, default=200, help="uploads in the burst of slow ones (0: none)")
    parser.add_argument("--slow-rate-kib", type=float, default=1024, help="each slow upload's pace, KiB/s")
    parser.add_argument("--settle-s", type=float, default=10, help="wait after a burst before reading RSS again")
    parser.add_argument("--set", action="append", default=[], metavar="PRISM_X__Y=V", help="an override, as environment")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = parser.parse_args()
    if not MemoryCgroup.available():
        sys.exit("bench.burst makes a memory cgroup: run it as root on a machine with cgroup v1, or v2 with the memory controller")
    limit = args.limit_mib * MIB if args.limit_mib else manifest_limit()
    uploads = Uploads.of(large_jpeg(), "prism-demo", uuid.uuid4().hex[:8])
    print(f"limit {mib(limit)}; {uploads.length() / 1e6:.1f} MB a request; config {args.config}; overrides {args.set}")
    run_dir = REPO_ROOT / "bench" / "results" / f"burst-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True)
    print(f"logs in {run_dir}")
    rows = run(args, limit, uploads, run_dir)
    print(table(rows, limit))
    if args.json:
        args.json.write_text(json.dumps({"limit": limit, "overrides": args.set, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
