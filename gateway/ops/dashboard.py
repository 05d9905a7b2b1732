"""The data behind /dashboard: a rolling window of finished requests and of
service samples, summarised as percentiles per stage and series over time.
With several gateway workers, each window also holds the other workers'
requests (gateway/ops/siblings.py), so any worker answers for the whole gateway."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from gateway.timing import STAGES, RequestTimer, ran
from protocol.siblings import FinishedRequest

BAND = 0.05  # of the window's requests, around a percentile's rank (breakdown_near)


def finished_request(timer: RequestTimer, ok: bool) -> FinishedRequest:
    ttft = timer.ttft_s
    tpot = timer.tpot_s
    return FinishedRequest(
        at=time.time(), ok=ok, stages_ms=timer.stages_ms() if ok else {},
        ttft_ms=None if ttft is None else ttft * 1000, tpot_ms=None if tpot is None else tpot * 1000,
        cache_hits=timer.cache_hits, cache_misses=timer.cache_misses,
    )


@dataclass(frozen=True)
class ServiceSample:
    at: float
    encoder_queue: int
    engine_waiting: int
    gateway_in_flight: int
    batches: int  # cumulative
    images_encoded: int  # cumulative


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def breakdown_near(ok: list[FinishedRequest], q: float) -> dict | None:
    """Where the time went for the requests whose TTFT is near its q-th percentile (the
    nearest `BAND` of them by rank): their mean stages, which add up to their mean TTFT.
    Each stage's own percentiles do not add up to anything: the slowest 5 % of encodes and
    of engine queues are rarely the same requests."""
    timed = sorted((r for r in ok if r.ttft_ms is not None), key=lambda r: r.ttft_ms)
    if not timed:
        return None
    rank = max(0, math.ceil(q / 100 * len(timed)) - 1)
    half = round(len(timed) * BAND / 2)
    near = timed[max(0, rank - half):rank + half + 1]
    return {"ttft": _round(sum(r.ttft_ms for r in near) / len(near)), "requests": len(near),
            "stages": {s: _round(sum(r.stages_ms.get(s, 0.0) for r in near) / len(near)) for s in STAGES}}


def _stage_summary(stage: str, ok: list[FinishedRequest]) -> dict:
    """A stage's own percentiles, over the requests it ran in, and the share of requests it ran in."""
    ms = [value for r in ok if ran(stage, value := r.stages_ms.get(stage, 0.0))]
    return {"p50": _round(percentile(ms, 50)), "p95": _round(percentile(ms, 95)),
            "ran": None if not ok else round(len(ms) / len(ok), 4)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


class DashboardWindow:
    """Finished requests over the last `span_s`: every one counted (per second, so throughput
    is exact at any rate), the latest `max_records` kept whole for percentiles."""

    def __init__(self, span_s: float = 300, bucket_s: float = 5, max_records: int = 50_000) -> None:
        self.span_s = span_s
        self.bucket_s = bucket_s
        self.records: deque[FinishedRequest] = deque(maxlen=max_records)
        self.counts: deque[tuple[int, list[int]]] = deque()  # (second, [answered, failed]), oldest first
        self.samples: deque[ServiceSample] = deque(maxlen=int(span_s) * 4)
        self.started = time.time()  # a window younger than its span holds only that long's requests

    def add(self, record: FinishedRequest) -> None:
        self.records.append(record)
        second = int(record.at)
        if not self.counts or self.counts[-1][0] < second:
            self.counts.append((second, [0, 0]))
            self._forget_before(record.at)  # so the counts stay a window's, whether or not anyone looks
        self._slot_of(second)[0 if record.ok else 1] += 1

    def _slot_of(self, second: int) -> list[int]:
        """A second's counts: the newest, or an earlier one for a record that arrives after a
        later one (another worker's)."""
        index = len(self.counts)
        while index > 0 and self.counts[index - 1][0] > second:
            index -= 1
        if index > 0 and self.counts[index - 1][0] == second:
            return self.counts[index - 1][1]
        slot = [0, 0]
        self.counts.insert(index, (second, slot))
        return slot

    def add_sample(self, sample: ServiceSample) -> None:
        self.samples.append(sample)

    def _forget_before(self, now: float) -> None:
        while self.counts and self.counts[0][0] + 1 <= now - self.span_s:  # wholly out of the window
            self.counts.popleft()

    def view(self) -> "WindowView":
        """The window as it is now, copied (a few milliseconds for a full one): `WindowView.summary`
        can then run off the event loop while requests keep arriving here."""
        now = time.time()
        self._forget_before(now)
        return WindowView(self, now, list(self.records), {second: list(c) for second, c in self.counts},
                          list(self.samples))

    def snapshot(self) -> dict:
        return self.view().summary()


@dataclass(frozen=True)
class WindowView:
    """A copy of a window, summarised off the event loop: a full window is a Python pass over every
    request it holds, which on the loop held every stream up each time a dashboard asked."""

    window: DashboardWindow  # its settings (span, buckets, start), never its records
    now: float
    records: list[FinishedRequest]
    counts: dict[int, list[int]]
    samples: list[ServiceSample]

    def summary(self) -> dict:
        now, span_s = self.now, self.window.span_s
        recent = [r for r in self.records if r.at >= now - span_s]
        answered, failed = sum(c[0] for c in self.counts.values()), sum(c[1] for c in self.counts.values())
        ok = [r for r in recent if r.ok]
        hits = sum(r.cache_hits for r in recent)
        lookups = hits + sum(r.cache_misses for r in recent)
        return {
            "window_s": span_s,
            "requests": answered + failed,
            "errors": failed,
            "throughput_rps": _round(answered / min(span_s, max(now - self.window.started, self.window.bucket_s))),
            "cache_hit_rate": None if not lookups else round(hits / lookups, 4),
            "stages": {s: _stage_summary(s, ok) for s in STAGES},
            "breakdown": {f"p{q}": breakdown_near(ok, q) for q in (50, 95)},
            "ttft": {"p50": _round(percentile([r.ttft_ms for r in ok if r.ttft_ms is not None], 50)), "p95": _round(percentile([r.ttft_ms for r in ok if r.ttft_ms is not None], 95))},
            "series": self._series(recent),
            "services": self._service_series(),
        }

    def _series(self, recent: list[FinishedRequest]) -> list[dict]:
        now, bucket_s = self.now, self.window.bucket_s
        buckets: dict[int, list[FinishedRequest]] = {}
        for record in recent:
            buckets.setdefault(int((now - record.at) // bucket_s), []).append(record)
        answered: dict[int, int] = {}
        for second, (done, _) in self.counts.items():
            age = int((now - second) // bucket_s)
            answered[age] = answered.get(age, 0) + done
        series = []
        for age in sorted(buckets.keys() | answered.keys(), reverse=True):
            rows = buckets.get(age, [])
            ttft = [r.ttft_ms for r in rows if r.ok and r.ttft_ms is not None]
            tpot = [r.tpot_ms for r in rows if r.ok and r.tpot_ms is not None]
            hits = sum(r.cache_hits for r in rows)
            lookups = hits + sum(r.cache_misses for r in rows)
            series.append({
                "t": round(now - age * bucket_s), "rps": round(answered.get(age, 0) / bucket_s, 3),
                "ttft_p50": _round(percentile(ttft, 50)), "ttft_p95": _round(percentile(ttft, 95)),
                "tpot_p50": _round(percentile(tpot, 50)), "tpot_p95": _round(percentile(tpot, 95)),
                "cache_hit_rate": None if not lookups else round(hits / lookups, 4),
            })
        return series

    def _service_series(self) -> list[dict]:
        samples = [s for s in self.samples if s.at >= self.now - self.window.span_s]
        out = []
        for before, after in zip(samples, samples[1:]):
            batches = after.batches - before.batches
            out.append({
                "t": round(after.at, 1), "encoder_queue": after.encoder_queue, "engine_waiting": after.engine_waiting,
                "gateway_in_flight": after.gateway_in_flight,
                "batch_size": None if batches <= 0 else round((after.images_encoded - before.images_encoded) / batches, 2),
            })
        return out
