"""A fault every interval while the soak's load runs, rotating over vLLM's
EngineCore (killed, then stopped past the stall timeout and continued), an
encoder replica (killed) and Redis (killed, restarted on the same port).

Each request's fate is classified so that a lost request stands out:
- ok: 200, and a stream that ended without an error event;
- refused: 429, or 503 "... is unavailable; retry shortly" (no replica up at
  admission: nothing was started for it);
- cut: the failure came after its first token (a stream's error event, or a
  non-streaming 503 "after the first token"): tokens cannot be taken back;
- lost: anything else, i.e. admitted, no token yet, and failed all the same.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil

from testing.redis_server import RedisServer

REFUSED_AT_ADMISSION = "is unavailable; retry shortly"
AFTER_FIRST_TOKEN = "after the first token"


def classify(response: httpx.Response, stream: bool) -> str:
    """ok, refused, cut or lost (see the module docstring)."""
    if response.status_code == 200:
        if not stream:
            return "ok"
        events = [line for line in response.text.splitlines() if line.startswith("data: {")]
        return "cut" if any('"error"' in event for event in events) else "ok"
    message = json.loads(response.text)["error"]["message"]
    if response.status_code == 429 or (response.status_code == 503 and message.endswith(REFUSED_AT_ADMISSION)):
        return "refused"
    return "cut" if AFTER_FIRST_TOKEN in message else "lost"


def services(root: psutil.Process, module: str) -> list[psutil.Process]:
    return [child for child in root.children() if module in " ".join(child.cmdline())]


def engine_core(engine: psutil.Process) -> psutil.Process | None:
    return next((p for p in engine.children(recursive=True) if _is_engine_core(p)), None)


def _is_engine_core(process: psutil.Process) -> bool:
    try:
        return "EngineCore" in process.name() or "EngineCore" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # vLLM's start-up runs short-lived helpers
        return False


@dataclass
class FaultSchedule:
    """Applies the next fault every `every_s` seconds from a thread until stopped."""

    launcher: psutil.Process  # `prism serve`: its children are the encoders and engines
    redis: RedisServer
    every_s: float
    stop_for_s: float  # how long an EngineCore stays stopped (past the engine's stall timeout)
    log: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _turn: int = 0

    def start(self) -> "FaultSchedule":
        threading.Thread(target=self._run, name="faults", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        faults = (self.kill_engine_core, self.kill_encoder, self.restart_redis, self.stop_engine_core)
        while not self._stop.wait(self.every_s):
            fault = faults[self._turn % len(faults)]
            replica = self._turn // len(faults)  # each round hits the other replica
            self._turn += 1
            try:
                self.log.append(f"{time.strftime('%H:%M:%S')} {fault(replica)}")
            except (psutil.Error, LookupError, RuntimeError) as exc:
                self.log.append(f"{time.strftime('%H:%M:%S')} {fault.__name__} skipped: {exc}")

    def _engine(self, replica: int) -> psutil.Process:
        engines = services(self.launcher, "llm_engine")
        return engines[replica % len(engines)]

    def kill_engine_core(self, replica: int) -> str:
        core = engine_core(self._engine(replica))
        if core is None:
            raise LookupError("engine still starting")
        core.kill()
        return f"EngineCore {core.pid} killed"

    def stop_engine_core(self, replica: int) -> str:
        core = engine_core(self._engine(replica))
        if core is None:
            raise LookupError("engine still starting")
        core.suspend()
        self._stop.wait(self.stop_for_s)
        if core.is_running():
            core.resume()
        return f"EngineCore {core.pid} stopped for {self.stop_for_s:g} s"

    def kill_encoder(self, replica: int) -> str:
        encoders = services(self.launcher, "vision_encoder")
        victim = encoders[replica % len(encoders)]
        os.kill(victim.pid, signal.SIGKILL)
        return f"encoder {victim.pid} killed"

    def restart_redis(self, _: int) -> str:
        self.redis.stop()
        self._stop.wait(5)
        self.redis.start()
        return "Redis killed, restarted 5 s later"
