"""How long the gateway's event loop takes to get to new work.

Everything a request waits on reaches the loop as a callback: a decoded image
from the intake threads, a reply from a ZMQ socket, the next piece of an HTTP
body. When one request's work holds the loop (parsing, base64, building a
response), every other request's callbacks wait behind it. A thread posts a
callback every `interval_s` (`call_soon_threadsafe`, as the intake pool's
results arrive) and the loop records how long it waited to run: the
`prism_gateway_loop_lag_seconds` histogram. A sustained lag of milliseconds
means this process is the bottleneck: add gateway workers (`gateway.workers`).

A probe from a thread, not a task on the loop: a task's timer only fires
after a long callback ends, so a task would never see the callback that held
the loop; the thread's post waits behind it and counts it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

INTERVAL_S = 0.1  # ten samples a second: nothing measurable, one post at a time


class LoopProbe:
    def __init__(self, loop: asyncio.AbstractEventLoop, observe: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
        self._loop = loop
        self._observe = observe
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._answered = threading.Event()  # one probe at a time: a blocked loop is not flooded
        self._thread = threading.Thread(target=self._run, name="loop-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self._answered.clear()
            try:
                self._loop.call_soon_threadsafe(self._ran, time.perf_counter())
            except RuntimeError:  # the loop is closed: the gateway is gone
                return
            while not self._answered.wait(self._interval_s):
                if self._stopping.is_set():
                    return

    def _ran(self, posted: float) -> None:
        self._observe(time.perf_counter() - posted)
        self._answered.set()
