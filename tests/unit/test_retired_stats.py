"""A service process that restarts or leaves keeps its counters in the gateway's sums
(gateway/ops/retired.py); what it held (queues, cache bytes) goes with it."""

from __future__ import annotations

import types

import msgspec
import pytest

from gateway.api.app import Gateway
from gateway.config import GatewayConfig
from gateway.ops.retired import GAUGES, RetiredTotals, counters
from protocol.stats import BATCH_IMAGE_BUCKETS, BATCH_PATCH_BUCKETS, EncoderStats, EngineStats, HistogramCounter, SharedTierStats

# Every field that is not a gauge is carried. A new field must be placed in one or the other.
COUNTED = {
    EncoderStats: {"cache_hits", "cache_misses", "cache_joins", "cache_evictions", "cache_collisions", "batches", "images_encoded",
                   "jobs_dropped", "batch_images", "batch_patches", "shared_cache", "stalls", "fetches", "fetch_misses", "pushes",
                   "push_refusals", "oom_splits", "pins_dropped", "displaced"},
    EngineStats: {"finished", "failed", "steps", "stalls", "embedding_cache_hits", "embeddings_fetched", "fetched_bytes",
                  "embedding_fetch_joins", "embeddings_pushed", "pushed_bytes", "displaced"},
    SharedTierStats: {"hits", "misses", "corrupt", "collisions", "errors", "writes", "writes_skipped", "reattaches"},
}


@pytest.mark.parametrize("struct", list(COUNTED), ids=lambda s: s.__name__)
def test_every_stats_field_is_a_counter_or_a_gauge(struct):
    fields = {field.name for field in msgspec.structs.fields(struct)}
    assert not GAUGES[struct] & COUNTED[struct]
    assert fields == GAUGES[struct] | COUNTED[struct], fields ^ (GAUGES[struct] | COUNTED[struct])


def histogram(bounds, *values):
    counter = HistogramCounter(bounds)
    for value in values:
        counter.observe(value)
    return counter.snapshot()


def encoder(boot: str, hits: int, queue: int, shared_hits: int | None) -> EncoderStats:
    return EncoderStats(
        boot_id=boot, queue_depth=queue, in_flight=3, cache_bytes=1000, cache_capacity_bytes=4000, cache_entries=2,
        cache_hits=hits, cache_misses=1, cache_joins=0, cache_evictions=0, cache_collisions=0, batches=2, images_encoded=5,
        jobs_dropped=0, batch_images=histogram(BATCH_IMAGE_BUCKETS, 1, 4), batch_patches=histogram(BATCH_PATCH_BUCKETS, 300),
        shared_cache=None if shared_hits is None else SharedTierStats(up=False, hits=shared_hits), vit_batches_now=1,
    )


def test_gone_processes_add_their_counters_and_none_of_their_gauges():
    retired = RetiredTotals()
    retired.retire(encoder("a", hits=10, queue=7, shared_hits=None))
    retired.retire(encoder("b", hits=5, queue=2, shared_hits=4))
    retired.retire(EngineStats("c", in_flight=2, waiting=1, finished=9, failed=1, steps=100))
    total, engine = retired.totals(live=[])
    assert (total.cache_hits, total.batches, total.images_encoded, total.shared_cache.hits) == (15, 4, 10, 4)
    assert total.batch_images.counts == tuple(2 * c for c in histogram(BATCH_IMAGE_BUCKETS, 1, 4).counts)
    assert (total.queue_depth, total.in_flight, total.cache_bytes, total.cache_entries, total.vit_batches_now) == (0, 0, 0, 0, 0)
    assert total.boot_id == "retired"
    assert (engine.finished, engine.steps, engine.in_flight, engine.waiting) == (9, 100, 0, 0)


def test_a_process_another_client_still_hears_from_is_not_counted_twice():
    """A routing map reloaded (new clients to the same processes, the old ones closed), or a pod
    back in the DNS answer after a moment out of it: its stats come live again."""
    retired = RetiredTotals()
    retired.retire(encoder("a", hits=10, queue=0, shared_hits=None))
    retired.retire(encoder("a", hits=12, queue=0, shared_hits=None))  # closed twice: its latest numbers, once
    retired.retire(encoder("b", hits=5, queue=0, shared_hits=None))
    assert retired.totals(live=[])[0].cache_hits == 17
    assert retired.totals(live=[encoder("a", hits=13, queue=1, shared_hits=None)])[0].cache_hits == 5
    assert retired.totals(live=[encoder("a", hits=13, queue=1, shared_hits=None), encoder("b", hits=6, queue=0, shared_hits=None)]) == (None, None)


def test_a_gone_process_s_counters_alone_are_its_stats_less_its_gauges():
    gone = counters(encoder("a", hits=10, queue=7, shared_hits=3))
    assert (gone.cache_hits, gone.queue_depth, gone.shared_cache.hits, gone.shared_cache.up) == (10, 0, 3, True)


def test_a_crash_looping_service_folds_into_one_total_and_each_restart_counts_once():
    """A restart is for good: once no client reports the old process, its counters fold
    into one total (a service restarting for days must not grow the gateway), and a second
    client that hears of the same restart later does not add it again."""
    retired = RetiredTotals()
    for boot in range(1000):
        retired.retire(encoder(f"boot-{boot}", hits=2, queue=1, shared_hits=None), restarted=True)
        assert retired.totals(live=[])[0].cache_hits == 2 * (boot + 1)
    assert retired._last == {} and len(retired._folded) == 1
    retired.retire(encoder("boot-999", hits=3, queue=0, shared_hits=None), restarted=True)
    assert retired.totals(live=[])[0].cache_hits == 2000


def test_a_restarted_process_another_client_still_reports_waits_for_it():
    retired = RetiredTotals()
    retired.retire(encoder("a", hits=10, queue=0, shared_hits=None), restarted=True)
    assert retired.totals(live=[encoder("a", hits=11, queue=0, shared_hits=None)]) == (None, None)
    retired.retire(encoder("a", hits=11, queue=0, shared_hits=None), restarted=True)  # that client hears of it too
    assert retired.totals(live=[])[0].cache_hits == 11
    assert retired._last == {}


class Replica:
    def __init__(self, stats, received_at: float, up: bool = True) -> None:
        self.stats, self.stats_received_at, self.up = stats, received_at, up


class Pools:
    """A served model's pools, as `Gateway.pools` reads them."""

    def __init__(self, name: str, encoders: list[Replica], engines: list[Replica]) -> None:
        self.name = name
        self.encoder, self.engine = types.SimpleNamespace(replicas=encoders), types.SimpleNamespace(replicas=engines)


def test_a_process_two_clients_hear_from_is_summed_once(monkeypatch):
    """A routing map reloaded: the new model's clients and the old one's, draining, hear from the
    same processes for up to drain_timeout_s; the sums must not double (and then fall back)."""
    monkeypatch.setattr("gateway.api.app.RETIRED", RetiredTotals())  # none of other tests' gone processes
    gateway = Gateway(GatewayConfig())
    engine = EngineStats("e", in_flight=1, waiting=0, finished=9, failed=0, steps=100)
    gateway.models = {"m": Pools("m", [Replica(encoder("a", hits=12, queue=1, shared_hits=None), 2.0)], [Replica(engine, 2.0)])}
    gateway.retired = [Pools("m", [Replica(encoder("a", hits=10, queue=1, shared_hits=None), 1.0)], [Replica(engine, 1.0)])]
    encoders, engines = gateway.service_stats()
    assert [e.cache_hits for e in encoders] == [12]
    assert [e.finished for e in engines] == [9]
    assert len(gateway.pools(retiring=False)) == 1


def test_a_reload_s_old_client_that_heard_a_process_last_keeps_the_sums_from_falling(monkeypatch):
    """The new model's client polled the process before the old one last did: once the old one
    closes (its drain over), its newer numbers stand until the new client hears newer ones."""
    retired = RetiredTotals()
    monkeypatch.setattr("gateway.api.app.RETIRED", retired)
    gateway = Gateway(GatewayConfig())
    old = Pools("m", [Replica(encoder("a", hits=12, queue=1, shared_hits=7), 1.7)],
                [Replica(EngineStats("e", in_flight=1, waiting=0, finished=108, failed=0, steps=100), 1.7)])
    new = Pools("m", [Replica(encoder("a", hits=10, queue=2, shared_hits=5), 1.0)],
                [Replica(EngineStats("e", in_flight=2, waiting=0, finished=100, failed=0, steps=90), 1.0)])
    gateway.models, gateway.retired = {"m": new}, [old]
    before = gateway.service_stats()
    for replica in [*old.encoder.replicas, *old.engine.replicas]:  # what closing the old clients retires
        retired.retire(replica.stats)
    gateway.retired = []
    (encoder_stats,), (engine_stats,) = gateway.service_stats()
    assert (engine_stats.finished, engine_stats.steps) == (before[1][0].finished, before[1][0].steps) == (108, 100)
    assert (encoder_stats.cache_hits, encoder_stats.shared_cache.hits) == (12, 7)
    assert (encoder_stats.queue_depth, engine_stats.in_flight) == (2, 2)  # what it holds: the live client's word


def test_two_clients_closed_in_either_order_keep_the_later_numbers():
    """Two models on one encoder: the client that heard the process last may be closed first."""
    retired = RetiredTotals()
    retired.retire(encoder("a", hits=100, queue=0, shared_hits=None), restarted=True)
    retired.retire(encoder("a", hits=95, queue=0, shared_hits=None), restarted=True)  # heard earlier, told later
    assert retired.totals(live=[])[0].cache_hits == 100


def test_a_replica_that_is_down_keeps_its_counters_and_holds_nothing(monkeypatch):
    """An encoder killed with images queued: its queue and in-flight requests are not the service's
    any more (the autoscaler reads the queue), while what it did stays in the sums."""
    monkeypatch.setattr("gateway.api.app.RETIRED", RetiredTotals())
    gateway = Gateway(GatewayConfig())
    engine = EngineStats("e", in_flight=4, waiting=2, finished=9, failed=0, steps=100)
    gateway.models = {"m": Pools("m", [Replica(encoder("a", hits=12, queue=7, shared_hits=None), 2.0, up=False)], [Replica(engine, 2.0)])}
    (down,), (live,) = gateway.service_stats()
    assert (down.cache_hits, down.queue_depth, down.in_flight, down.cache_bytes) == (12, 0, 0, 0)
    assert (live.in_flight, live.waiting) == (4, 2)


def test_a_replica_of_other_buckets_is_left_out_of_the_live_histogram():
    """Two versions side by side during a rolling change: the counts are read against the gateway's
    own buckets, never another version's (a histogram without its +Inf bucket reads as NaN)."""
    from gateway.ops.metrics import merge_histograms

    ours = histogram(BATCH_IMAGE_BUCKETS, 1, 4, 100)
    theirs = histogram((1, 2, 4), 1, 2, 3)
    for order in ([ours, theirs], [theirs, ours]):
        merged = merge_histograms(order, BATCH_IMAGE_BUCKETS)
        assert merged.bounds == BATCH_IMAGE_BUCKETS and merged.counts == ours.counts and merged.total == ours.total
    assert sum(merge_histograms([theirs], BATCH_IMAGE_BUCKETS).counts) == 0
