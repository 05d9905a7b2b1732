"""The counters of service processes that are gone, kept in the gateway's sums.

The gateway exports the services' counters summed over replicas (cache hits,
images fetched, batches). A replica that restarts counts from zero again, and
one that leaves the set takes its numbers with it: either way the sum would
fall. Prometheus reads a fall as a reset of the whole sum, and `rate()` then
counts every other replica's total again as new, a burst as large as all the
traffic so far. So the last numbers a gone process reported stay here, and the
sums add them (`Gateway.service_stats`). What it counted between its last
heartbeat and its end is lost: a stats interval's worth.

Every field of the stats messages is either a counter (carried) or a gauge
(what a gone process holds is nothing): `tests/unit/test_retired_stats.py`
fails on a field that is neither, so a new one must be placed.
"""

from __future__ import annotations

import msgspec

from gateway.ops.metrics import merge_histograms
from protocol.stats import EncoderStats, EngineStats, HistogramSnapshot, SharedTierStats

# What a process holds or is, not what it has done.
GAUGES = {
    EncoderStats: {"boot_id", "queue_depth", "queue_bytes", "in_flight", "cache_bytes", "cache_capacity_bytes", "cache_entries",
                   "state", "vit_batches_now", "vit_batches_most"},
    EngineStats: {"boot_id", "in_flight", "waiting", "state"},
    SharedTierStats: {"up"},
}


def counters(stats):
    """`stats` with every gauge at nothing (its default, 0, or "retired" for a boot id): a gone
    process's contribution to the sums."""
    gauges = {field.name: _nothing(field) for field in msgspec.structs.fields(stats) if field.name in GAUGES[type(stats)]}
    if getattr(stats, "shared_cache", None) is not None:
        gauges["shared_cache"] = counters(stats.shared_cache)
    return msgspec.structs.replace(stats, **gauges)


def _nothing(field: msgspec.structs.FieldInfo):
    if field.default is not msgspec.NODEFAULT:
        return field.default
    return "retired" if field.type is str else 0


def added(total, stats):
    """The counters of `total` (None: none yet) plus those of `stats`, gauges at nothing."""
    stats = counters(stats)
    if total is None:
        return stats
    return msgspec.structs.replace(stats, **{name: _sum(getattr(total, name), value)
                                             for name, value in msgspec.structs.asdict(stats).items()
                                             if name not in GAUGES[type(stats)]})


def _sum(a, b):
    if a is None or b is None:  # an optional part (the shared tier) that one side lacks
        return b if a is None else a
    if isinstance(b, HistogramSnapshot):
        # A process of another version, other buckets: the newer one's alone (merge_histograms leaves the other out).
        return merge_histograms([a, b], b.bounds)
    if isinstance(b, SharedTierStats):
        return added(a, b)
    return a + b


def _later(live, last):
    """`live` with each counter at the later of two readings of one process (its counters only grow)."""
    later = {}
    for name, value in msgspec.structs.asdict(last).items():
        mine = getattr(live, name)
        if name in GAUGES[type(live)] or value is None or mine is None:
            continue
        if isinstance(value, HistogramSnapshot):
            later[name] = value if sum(value.counts) > sum(mine.counts) else mine
        elif isinstance(value, SharedTierStats):
            later[name] = _later(mine, value)
        else:
            later[name] = max(mine, value)
    return msgspec.structs.replace(live, **later)


class RetiredTotals:
    """The last counters of every encoder and engine process this gateway process stopped
    hearing from. A process is counted here only while no replica reports it: a client
    closed while its process lives on (a routing map reloaded, a pod that left the DNS
    answer for a moment) must not count it twice, so those are kept by boot id. A process
    that restarted is gone for good: once no client reports it, its counters fold into one
    total, so a crash-looping service costs a boot id here per restart, not its stats."""

    def __init__(self) -> None:
        self._last: dict[str, EncoderStats | EngineStats] = {}
        self._ended: set[str] = set()  # boot ids in _last whose process restarted
        self._folded: dict[type, EncoderStats | EngineStats] = {}
        self._folded_ids: set[str] = set()

    def retire(self, stats, restarted: bool = False) -> None:
        """The last stats of a client that was closed, or (`restarted`) whose process restarted."""
        if stats.boot_id in self._folded_ids:  # a second client hearing of the same restart
            return
        last = counters(stats)
        if (before := self._last.get(stats.boot_id)) is not None:  # another client's, maybe heard later
            last = _later(last, before)
        self._last[stats.boot_id] = last
        if restarted:
            self._ended.add(stats.boot_id)

    def caught_up(self, stats):
        """A live client's `stats`, each counter no lower than the last a closed client heard from
        the same process: during a reload's drain the old client may have polled it last, and
        its newer numbers, once it closes, must not give way to the live client's older ones."""
        last = self._last.get(stats.boot_id)
        return stats if last is None else _later(stats, last)

    def totals(self, live: list) -> tuple[EncoderStats | None, EngineStats | None]:
        """(encoders', engines') counters of the processes no stats in `live` come from."""
        reporting = {stats.boot_id for stats in live}
        self._fold(self._ended - reporting)
        total = dict(self._folded)
        for boot_id, stats in self._last.items():
            if boot_id not in reporting:
                total[type(stats)] = added(total.get(type(stats)), stats)
        return total.get(EncoderStats), total.get(EngineStats)

    def _fold(self, boot_ids: set[str]) -> None:
        for boot_id in boot_ids:
            stats = self._last.pop(boot_id)
            self._folded[type(stats)] = added(self._folded.get(type(stats)), stats)
            self._folded_ids.add(boot_id)
        self._ended -= boot_ids


RETIRED = RetiredTotals()  # one per gateway process: its sums cover every model
