"""A throwaway redis-server on a loopback port (for tests and benchmarks): no
persistence, LRU past 256 MB. `stop` (SIGKILL) and `start` again keep the
port, to stage an outage and a recovery."""

from __future__ import annotations

import shutil
import subprocess
import time

import redis


class RedisServer:
    def __init__(self, port: int, binary: str | None = None) -> None:
        self.port = port
        self.binary = binary or shutil.which("redis-server") or "redis-server"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:  # until it answers PING
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
