"""The gateway's memory: what requests hold is counted against a budget sized
from the memory the gateway may use, so that a burst of large uploads is
refused (429 + Retry-After) instead of growing the process past its
container's limit, where the kernel kills it with every request it holds.

Sizing, once the gateway has started (`MemoryPlan`):
- limit: gateway.memory_limit_bytes, else its container's (common/container.py),
  else the machine's memory; with several workers, each has its share;
- budget: limit × gateway.memory_use_fraction, less the process's own RSS at
  that moment (Python, torch, the app: about 0.55 GB), and where videos are
  served, the idle video decoder processes' (`IDLE_DECODERS`);
- kept heap: gateway.kept_heap_bytes, else an eighth of the limit (at most
  1 GiB): freed memory kept for the next requests (`HeapKeeper`).

What one request holds (`MemoryHold`):
- its body, counted as BODY_COPIES × Content-Length from admission (before a
  byte of it is read) to its end: while it is read, uvicorn's buffer and the
  copy it hands over; then the parsed request (a data URL is a str as long)
  and each image's bytes (3/4 of its base64). A body without Content-Length
  is counted as it arrives;
- an http(s) image, from its response on, BODY_COPIES × the size it
  declares (gateway.max_image_bytes where it declares none) while it is
  read, then its size; nothing while its host is looked up and connected;
- an image or a video being decoded, its `decoding_bytes` (a video's with
  its decoder process and that process's copy of the bytes, from its
  header's read on, which admits four frames at the size limit for the
  container's opening); then its pixels
  (a video's frames) until the encoder has answered for them
  (gateway/routing/handoff.py, `_rounds`);
- replies waiting to be sent to the client (gateway/routing/clients.py ReplyQueue).

Bodies may take BODY_SHARE of the budget; past it a request is refused at
admission. The rest is room for decodes and fetches: they come after the
body was read, so they wait for room (gateway.memory_wait_s, then 503)
instead of being refused at once. Bodies never take that room, and every
decode ends, so a wait lasts only until others finish; an image that would
not fit in the whole budget is a 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

import psutil

from common.config import ConfigError
from common.container import memory_limit
from common.malloc import keep_at_most, trim
from gateway.ops import metrics
from gateway.errors import APIError

log = logging.getLogger("prism.gateway")

BODY_COPIES = 2
BODY_SHARE = 0.75
RETRY_AFTER = {"Retry-After": "1"}
TRIM_EVERY_S = 10
# The memory of a multi-worker gateway's supervisor (`python -m gateway` imports its config and
# gateway/ops/workers.py, not the app and torch): about 40 MB, rounded up.
SUPERVISOR_BYTES = 64 * 2**20
# A video decoder process's own memory (gateway/intake/video/decoders.py: Python, OpenCV, what glibc
# keeps after a job). A job admits its decoder's with what it decodes; the IDLE_DECODERS kept between
# jobs are left out of the budget.
DECODER_PROCESS_BYTES = 40 * 2**20
IDLE_DECODERS = 2


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def process_rss() -> int:
    return psutil.Process().memory_info().rss


class MemoryBudget:
    """This process's budget; the event loop is single-threaded, so no lock."""

    def __init__(self, wait_s: float = 10, label: str = "") -> None:
        self.capacity: int | None = None  # set at start-up (MemoryPlan); None: nothing is refused
        self.largest: int | None = None  # the planned budget, whatever the process's own memory leaves of it now
        self.wait_s = wait_s
        self.label = label  # the worker's share, said in refusals (WorkerSlot.label)
        self.held = 0  # admitted: bodies, images, pixels, replies
        self.working = 0  # decodes and fetches under way
        self._room = asyncio.Event()

    @property
    def in_use(self) -> int:
        return self.held + self.working

    def size(self, capacity: int) -> None:
        self.capacity = self.largest = capacity

    def _changed(self) -> None:
        metrics.MEMORY_HELD.set(self.in_use)

    def admit(self, nbytes: int, what: str) -> None:
        """Count `nbytes` more of a request's own: 413 if more than any request
        may hold, 429 if the budget has no room for it now."""
        if self.capacity is not None:
            if nbytes > self.largest * BODY_SHARE:
                raise APIError(413, f"{what} needs about {mib(nbytes)} of the gateway's memory; it admits at most "
                               f"{mib(int(self.largest * BODY_SHARE))} a request{self.label} (gateway.memory_limit_bytes, "
                               "or its container's limit)", code="request_too_large")
            if self.held + nbytes > self.capacity * BODY_SHARE or self.in_use + nbytes > self.capacity:
                raise APIError(429, f"the gateway's memory is held by requests in flight ({mib(self.in_use)} of "
                               f"{mib(self.capacity)}{self.label}; {what} needs {mib(nbytes)}); retry shortly",
                               code="memory_full", headers=RETRY_AFTER)
        self.take(nbytes)

    def take(self, nbytes: int) -> None:
        """Count bytes that are already there (they cannot be refused)."""
        self.held += nbytes
        self._changed()

    def give(self, nbytes: int) -> None:
        self.held -= nbytes
        self._freed()

    def _freed(self) -> None:
        self._room.set()  # waiting decodes and fetches look again
        self._changed()

    async def start_work(self, nbytes: int, what: str) -> None:
        """Room for a decode or a fetch: waits up to `wait_s` for it (503 then),
        413 if it would not fit in the whole budget."""
        if self.capacity is not None and nbytes > self.largest:
            raise APIError(413, f"{what} needs about {mib(nbytes)} of the gateway's memory, more than its whole budget "
                           f"of {mib(self.largest)}{self.label} (gateway.memory_limit_bytes, or its container's limit)",
                           code="image_too_large")
        try:
            async with asyncio.timeout(self.wait_s):
                while self.capacity is not None and self.in_use + nbytes > self.capacity:
                    self._room.clear()
                    await self._room.wait()
        except TimeoutError:
            raise APIError(503, f"no room in the gateway's memory for {what} within {self.wait_s:g} s "
                           "(gateway.memory_wait_s); retry shortly", code="memory_full", headers=RETRY_AFTER) from None
        self.working += nbytes
        self._changed()

    def end_work(self, nbytes: int) -> None:
        self.working -= nbytes
        self._freed()


class MemoryHold:
    """One request's bytes in the budget, all given back when it ends."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0
        self.released = False

    def admit(self, nbytes: int, what: str) -> None:
        self.budget.admit(nbytes, what)
        self.held += nbytes

    def take(self, nbytes: int) -> None:
        if not self.released:
            self.budget.take(nbytes)
            self.held += nbytes

    def give(self, nbytes: int) -> None:
        if not self.released:
            nbytes = min(nbytes, self.held)
            self.budget.give(nbytes)
            self.held -= nbytes

    @contextlib.asynccontextmanager
    async def working(self, nbytes: int, what: str):
        """`nbytes` counted while the block runs (a decode, a fetch)."""
        await self.budget.start_work(nbytes, what)
        try:
            yield
        finally:
            self.budget.end_work(nbytes)

    def release(self) -> None:
        self.give(self.held)
        self.released = True


# The request this task serves: its replies are counted while they wait (gateway/routing/clients.py).
current_hold: ContextVar[MemoryHold | None] = ContextVar("prism_memory_hold", default=None)


def hold(nbytes: int) -> None:
    """Count `nbytes` as the current request's until it ends or lets them go (none outside a request)."""
    if (request := current_hold.get()) is not None:
        request.take(nbytes)


def let_go(nbytes: int) -> None:
    """Give back `nbytes` the current request held and keeps no more (its pixels, once its encoder has them)."""
    if (request := current_hold.get()) is not None:
        request.give(nbytes)


@contextlib.asynccontextmanager
async def working(nbytes: int, what: str):
    """`nbytes` counted as the current request's while the block runs; it
    waits for room first (`MemoryBudget.start_work`)."""
    request = current_hold.get()
    if request is None:
        yield
        return
    async with request.working(nbytes, what):
        yield


@dataclass(frozen=True)
class MemoryPlan:
    limit: int  # this process's
    source: str  # where the limit comes from, for the log
    at_start: int  # RSS once started
    budget: int
    kept_heap: int

    @classmethod
    def size(cls, config, workers: int, rss: int) -> "MemoryPlan":
        if config.memory_limit_bytes is not None:
            limit, source = int(config.memory_limit_bytes), "gateway.memory_limit_bytes"
        else:
            limit, source = memory_limit()
        if workers > 1:  # the workers' supervisor (python -m gateway, without the app) takes its own first
            limit, source = (limit - SUPERVISOR_BYTES) // workers, f"{source}, a share of {workers} workers"
        planned = int(limit * config.memory_use_fraction)
        decoders = IDLE_DECODERS * DECODER_PROCESS_BYTES if config.max_videos_per_request > 0 else 0
        if planned <= rss + decoders:
            also = f" and its idle video decoders' {mib(decoders)}" if decoders else ""
            raise ConfigError(f"gateway: {mib(limit)} of memory ({source}) × gateway.memory_use_fraction "
                              f"{config.memory_use_fraction:g} = {mib(planned)}, which the gateway's own {mib(rss)} at "
                              f"start-up{also} fill already: nothing is left for requests. Raise the container's memory "
                              "limit or gateway.memory_limit_bytes")
        kept = min(limit // 8, 2**30) if config.kept_heap_bytes is None else int(config.kept_heap_bytes)
        return cls(limit, source, rss, planned - rss - decoders, kept)


class HeapKeeper:
    """Freed heap kept for reuse, within bounds (common/malloc.py trims past them):
    - `plan.kept_heap` bytes past the process's memory at start and what
      requests hold, at most every TRIM_EVERY_S: what a trim cannot give back
      (memory in use that the budget does not count) would otherwise have it
      trim at every check;
    - the plan's ceiling (its memory at start plus the budget), at every check.
    A trim while no request holds anything leaves the process's own memory,
    which grows as it runs (Python's caches, heap fragments): the budget is
    then what the ceiling leaves beside that, not beside the memory at start."""

    def __init__(self, plan: MemoryPlan, budget: MemoryBudget) -> None:
        self.plan = plan
        self.budget = budget
        self.ceiling = plan.at_start + plan.budget
        self._next_trim = 0.0
        keep_at_most(plan.kept_heap)

    async def check(self) -> None:
        now, rss, held = time.monotonic(), process_rss(), self.budget.in_use
        past_kept = now >= self._next_trim and rss - self.plan.at_start - held > self.plan.kept_heap
        if not past_kept and rss <= self.ceiling:
            return
        self._next_trim = now + TRIM_EVERY_S
        await asyncio.to_thread(trim)
        if held == 0 and self.budget.in_use == 0:
            self._resize(process_rss())

    def _resize(self, own: int) -> None:
        capacity = max(0, self.ceiling - max(own, self.plan.at_start))
        if capacity < 0.9 * self.budget.capacity:
            log.warning("memory: the gateway holds %s idle (%s at start): %s left for requests", mib(own),
                        mib(self.plan.at_start), mib(max(capacity, 0)))
        self.budget.capacity = capacity
        metrics.MEMORY_BUDGET.set(capacity)
