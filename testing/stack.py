"""Run the whole local stack as a child process (for tests and benchmarks).

Everything the stack needs differently (port, socket paths, dtype, pixel
budget) is passed as PRISM_* environment overrides of configs/cpu-demo.yaml.
The checkpoint defaults to the random-weights one: its generations run to
max_tokens, which streaming, timing and fault tests rely on; the trained demo
model answers in a few tokens (pass `model=SHAPES_MODEL` for it).
Readiness is the gateway's /health answering, which it does only after its
start-up handshake with the encoder and the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from common.config import REPO_ROOT
from common.supervisor import stop_group
from prism.demo_model import RANDOM_MODEL


def _ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A free loopback port outside the kernel's ephemeral range.

    A port from bind(0) is free now, but the gateway binds it only after its
    start-up handshake (tens of seconds), and meanwhile every bind(0) and
    every outgoing connection on the machine draws from that same range (in
    the parity tests, two vLLM engines start beside it). Below it, only
    another caller of this function competes, and the random start makes two
    callers unlikely to collide."""
    ephemeral = _ephemeral_ports()
    candidates = [port for port in range(20000, 32768) if port not in ephemeral]
    start = random.randrange(len(candidates))
    for port in candidates[start:] + candidates[:start]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32767")


def wait_for_health(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until a gateway's /health answers 200 (it does only after its service handshake)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling an HTTP endpoint: the handshake behind it is the real signal
    raise TimeoutError(f"{base_url} not ready within {timeout_s} s")


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a gateway's /metrics, by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def log_tail(path: Path, max_chars: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-max_chars:]
    except OSError as exc:
        return f"(unreadable: {exc})"


@contextlib.contextmanager
def serving(process: subprocess.Popen, base_url: str, timeout_s: float) -> Iterator[str]:
    """`base_url` once the server `process` answers /health; the process is stopped on exit."""
    try:
        wait_for_health(base_url, process, timeout_s)
        yield base_url
    finally:
        process.terminate()
        process.wait(30)


@dataclass
class LocalStack:
    run_dir: Path
    overrides: dict[str, str] = field(default_factory=dict)
    model: Path = RANDOM_MODEL
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    encoder_replicas: int = 1
    engine_replicas: int = 1
    transport: str = "ipc"  # or "tcp": loopback ports, as services on other hosts would use
    routed_by_config: bool = False  # the config's gateway.models says where each model's services listen
    process: subprocess.Popen | None = None
    _tcp_ports: dict[str, list[int]] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _addresses(self, service: str, count: int) -> list[str]:
        if self.transport == "tcp":
            ports = self._tcp_ports.setdefault(service, [])
            while len(ports) < count:
                ports.append(free_port())
            return [f"tcp://127.0.0.1:{port}" for port in ports]
        return [f"ipc://{self.run_dir}/{service}-{i}.sock" for i in range(count)]

    @property
    def encoder_addresses(self) -> list[str]:
        return self._addresses("encoder", self.encoder_replicas)

    @property
    def engine_addresses(self) -> list[str]:
        return self._addresses("engine", self.engine_replicas)


    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(PRISM_MODEL=str(self.model), PRISM_GATEWAY__PORT=str(self.port))
        if not self.routed_by_config:
            env.update(
                PRISM_GATEWAY__ENCODER_ADDRESSES=json.dumps(self.encoder_addresses),  # JSON is YAML
                PRISM_GATEWAY__ENGINE_ADDRESSES=json.dumps(self.engine_addresses),
            )
        env.update(self.overrides)
        return env

    def start(self, timeout_s: float = 420) -> "LocalStack":
        self.launch()
        self.wait_ready(timeout_s)
        return self

    def launch(self) -> subprocess.Popen:
        """`prism serve`, not waited for."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.stack_log, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prism", "serve"], cwd=REPO_ROOT, env=self.environment(),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        return self.process

    def child_pid(self, module: str, address: str | None = None) -> int:
        """A process the launcher started: by module, and by the address it was told to bind when
        several run (replicas)."""
        for child in psutil.Process(self.process.pid).children():
            with contextlib.suppress(psutil.Error):  # one gone meanwhile
                if module in " ".join(child.cmdline()) and (address is None or address in child.environ().values()):
                    return child.pid
        raise LookupError(f"{module} {address or ''}")

    @property
    def gateway_pid(self) -> int:
        """The gateway's process: the launcher's child `python -m gateway` (the launcher itself supervises
        the workers of a multi-worker gateway, and stands for them here)."""
        try:
            return self.child_pid("-m gateway")
        except LookupError:
            return self.process.pid

    @property
    def stack_log(self) -> Path:
        return self.log_path or self.run_dir / "stack.log"

    def wait_ready(self, timeout_s: float = 420) -> None:
        """Until the launched stack answers /health (its log's end in the error if it never does)."""
        try:
            wait_for_health(self.base_url, self.process, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            # The log's end says why; CI keeps only what the test prints, not the run directory.
            raise type(exc)(f"{exc}; the end of {self.stack_log}:\n{log_tail(self.stack_log)}") from None

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            stop_group(self.process, grace_s=30)  # the services it started stop with it (common/supervisor.py)

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
