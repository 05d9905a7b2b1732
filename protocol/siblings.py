"""What a gateway's worker processes tell each other (`gateway.workers` > 1):
each finished request, so every worker's dashboard window holds them all, and
each worker's requests in flight."""

from __future__ import annotations

from protocol.base import Message


class FinishedRequest(Message):
    """One request as the dashboard keeps it."""

    at: float  # wall clock
    ok: bool
    stages_ms: dict[str, float]
    ttft_ms: float | None
    tpot_ms: float | None
    cache_hits: int
    cache_misses: int


class WorkerLoad(Message):
    worker: int
    in_flight: int


SiblingInbound = FinishedRequest | WorkerLoad
