"""Service statistics the gateway polls (and exports), so one scrape of the
gateway shows every service even when they run on other hosts."""

from __future__ import annotations

import bisect
import enum

import msgspec

from protocol.base import Message

BATCH_IMAGE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BATCH_PATCH_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144)


class SharedTierStats(msgspec.Struct, array_like=True):
    """Counters of an encoder's shared (Redis) cache tier."""

    up: bool = True
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # unreadable header or checksum mismatch
    collisions: int = 0
    errors: int = 0  # failed Redis calls (each one starts an outage)
    writes: int = 0
    writes_skipped: int = 0  # queue full or Redis down
    reattaches: int = 0  # outages ended: a call succeeded again after one failed


class HistogramSnapshot(msgspec.Struct, array_like=True, frozen=True, gc=False):
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket (not cumulative); one more than bounds (+Inf)
    total: float  # sum of observations

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus-style (le, cumulative count) pairs."""
        out, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += count
            out.append((bound, running))
        return out


class HistogramCounter:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)


class ServiceState(enum.IntEnum):
    """What a service says of itself in every heartbeat; only SERVING takes new work."""

    SERVING = 0
    DRAINING = 1  # shutting down: finishing its requests, taking no new ones
    STALLED = 2  # its compute made no progress within its stall timeout; it fails what it holds
    DEAD = 3  # its compute is gone (vLLM's engine core died); it exits for its supervisor to restart it


class StatsRequest(Message):
    sender: str


class EncoderStats(Message):
    boot_id: str  # changes when the process restarts: its in-flight work is gone
    queue_depth: int  # images waiting for a batch
    in_flight: int  # requests accepted and not yet answered
    cache_bytes: int
    cache_capacity_bytes: int
    cache_entries: int
    cache_hits: int
    cache_misses: int
    cache_joins: int  # requests that joined an encode already queued for the same key
    cache_evictions: int
    cache_collisions: int  # key matched, identity did not: refused as a hit
    batches: int
    images_encoded: int
    jobs_dropped: int  # queued encodes dropped because every request waiting on them went away
    batch_images: HistogramSnapshot
    batch_patches: HistogramSnapshot
    shared_cache: SharedTierStats | None = None  # None: no shared tier configured
    state: ServiceState = ServiceState.SERVING
    stalls: int = 0  # batches that ran far past their predicted time
    fetches: int = 0  # images engines fetched from here
    fetch_misses: int = 0  # asked for and no longer held (the gateway re-encodes them)
    pushes: int = 0  # images pushed to the engine of the request they were encoded for
    push_refusals: int = 0  # pushes not queued (engine not connected yet, or its queue full): fetched instead
    oom_splits: int = 0  # batches (or halves) split in two for want of device memory
    vit_batches_now: int = 0  # the main lane's batches in their ViT stage now
    vit_batches_most: int = 0  # the most that ever were at once (at most encoder.vit_threads)
    pins_dropped: int = 0  # tokens pinned for an engine's fetch let go early, past encoder.handoff_max_mb
    queue_bytes: int = 0  # what the waiting work's pixels hold (encoder.max_queue_bytes bounds it)
    displaced: int = 0  # requests refused from the full queue for more urgent work (429 "displaced")


class EngineStats(Message):
    boot_id: str
    in_flight: int  # requests in vLLM
    waiting: int  # in vLLM, no token yet
    finished: int
    failed: int
    state: ServiceState = ServiceState.SERVING
    steps: int = 0  # vLLM engine-core steps seen (the stall watchdog's progress signal)
    stalls: int = 0  # times the watchdog saw no step within engine.stall_timeout_s
    embedding_cache_hits: int = 0  # images served from the engine's own LRU: nothing fetched
    embeddings_fetched: int = 0  # images fetched from an encoder or the shared tier
    fetched_bytes: int = 0  # on the engine's sockets to encoders (headers and tensors)
    embedding_fetch_joins: int = 0  # images another request was fetching already: waited for, not fetched again
    embeddings_pushed: int = 0  # images whose tokens their encoder pushed here unasked, used by a request
    pushed_bytes: int = 0  # tensor bytes encoders pushed here
    displaced: int = 0  # requests refused from the full queue for a more urgent one (429 "displaced")
