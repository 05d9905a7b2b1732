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
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        env.update(
            PRISM_MODEL=str(self.model),
            PRISM_GATEWAY__PORT=str(self.port),
            PRISM_GATEWAY__ENCODER_ADDRESSES=json.dumps(self.encoder_addresses),  # JSON is YAML
            PRISM_GATEWAY__ENGINE_ADDRESSES=json.dumps(self.engine_addresses),
        )
        env.update(self.overrides)
        return env

    def start(self, timeout_s: float = 420) -> "LocalStack":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path or self.run_dir / "stack.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prism", "serve"], cwd=REPO_ROOT, env=self.environment(),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        try:
            wait_for_health(self.base_url, self.process, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise type(exc)(f"{exc}; see {self.run_dir}/stack.log") from None

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
