"""Every Prometheus metric Prism exports, defined in one place.

Units are seconds; labels are few. The encoder and the engine report their
stages in their replies and their counters in the stats the gateway polls, so
one scrape of the gateway shows the whole system even across hosts.

With several gateway workers, PROMETHEUS_MULTIPROC_DIR is set (by
gateway/ops/workers.py) and each worker's metrics live in files there: a scrape,
whichever worker answers, sums every worker's counters and histograms and the
live workers' gauges (prometheus-client's multiprocess mode). What the gateway
polls from the services is exported once, as the first worker polled it
(`SERVICES_FILE`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from gateway.timing import STAGES, ran
from protocol.stats import BATCH_IMAGE_BUCKETS, BATCH_PATCH_BUCKETS, HistogramSnapshot, ServiceState

# 50 µs (a cache lookup, a parse) to minutes (a long answer's end to end), with steps of at
# most 1.5x from 10 ms to ten seconds, where stages and TTFTs fall on a GPU (tens to hundreds
# of ms) and on a CPU (seconds): histogram_quantile interpolates linearly inside a bucket, so a
# wider step there put a p95 of 0.30 s at 0.49 s. Below 10 ms, a stage that takes a tenth of
# the first bucket is still told apart.
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075,
                   0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1, 1.5, 2, 3, 4, 5, 7.5, 10, 15, 25, 60, 120, 300)
# A decode step: a few ms on a GPU to a few hundred on two cores, finely enough
# that a quantile is not one wide bucket's interpolation; seconds where another
# request's prefill holds every stream's next step.
DECODE_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# A request's visual tokens: one image at the 7B budget is 256-1,280, so the
# buckets step by about 1.5x through the range most requests fall in.
TOKEN_BUCKETS = (16, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 2048, 3072, 4096, 8192, 16384, 32768)
# Original image sizes, by megapixels: thumbnails, ~720p, ~1080p, ~4K, larger.
IMAGE_SIZE_BUCKETS = ((0.25, "le_0.25mp"), (1.0, "le_1mp"), (2.2, "le_2.2mp"), (8.5, "le_8.5mp"), (float("inf"), "gt_8.5mp"))

REQUESTS = Counter("prism_requests_total", "Chat completion requests by HTTP status and reason", ["status", "reason"])
# Each stage where it ran, `unaccounted` for every answered request (gateway/timing.py, ran): a
# stage's mean share of TTFT is its _sum over unaccounted's _count.
STAGE_SECONDS = Histogram("prism_stage_seconds", "Time to first token by stage, where the stage ran", ["stage"],
                          buckets=LATENCY_BUCKETS)
for _stage in STAGES:
    STAGE_SECONDS.labels(_stage)  # exported at 0 before a request runs it
TTFT_SECONDS = Histogram("prism_ttft_seconds", "Request arrival to first token: sent (a stream), or at the gateway (a whole "
                         "answer, which the client has only with its last)", buckets=LATENCY_BUCKETS)
TPOT_SECONDS = Histogram("prism_tpot_seconds", "Time per output token after the first, per request", buckets=DECODE_BUCKETS)
ITL_SECONDS = Histogram("prism_itl_seconds", "Gap between consecutive tokens (a delta of several spreads its gap over them)",
                        buckets=DECODE_BUCKETS)
E2E_SECONDS = Histogram("prism_e2e_seconds", "Request arrival to last byte", buckets=LATENCY_BUCKETS)
VISUAL_TOKENS = Histogram("prism_visual_tokens_per_request", "Visual tokens a request's images became", buckets=TOKEN_BUCKETS)
IMAGES = Counter("prism_images_total", "Images accepted, by original size", ["size"])
IN_FLIGHT = Gauge("prism_in_flight_requests", "Requests being served", ["service"], multiprocess_mode="livesum")
# Per replica, as this gateway's workers see them: what they sent, and what is still open.
REPLICA_REQUESTS = {
    "encoder": Counter("prism_encoder_replica_requests", "Encode requests sent to each encoder replica", ["model", "replica"]),
    "engine": Counter("prism_engine_replica_requests", "Generate requests sent to each engine replica", ["model", "replica"]),
}
REPLICA_OUTSTANDING = {
    "encoder": Gauge("prism_encoder_replica_outstanding", "Requests sent to the encoder replica and not yet answered",
                     ["model", "replica"], multiprocess_mode="livesum"),
    "engine": Gauge("prism_engine_replica_outstanding", "Requests generating on each engine replica",
                    ["model", "replica"], multiprocess_mode="livesum"),
}
FAILOVERS = Counter("prism_replica_failovers", "Requests moved to another replica after a 503 or 429", ["service"])
for _service in REPLICA_REQUESTS:
    FAILOVERS.labels(_service)  # exported at 0 before the first
# How long a callback posted from another thread waited for the gateway's event loop (gateway/ops/loop_probe.py).
LOOP_LAG_SECONDS = Histogram(
    "prism_gateway_loop_lag_seconds", "How long new work waited for the gateway's event loop (sampled 10 times a second)",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),  # stalls of seconds too
)
# Repeated images sent to the engine by a reference this gateway process kept, with no encoder round (gateway/routing/handoff.py, Delivery.KNOWN).
IMAGES_BY_KNOWN_REFERENCE = Counter("prism_gateway_images_by_known_reference",
                                    "Images sent to the engine by a reference kept from an earlier encode, without asking an encoder")
VIDEOS_BY_KNOWN_REFERENCE = Counter("prism_gateway_videos_by_known_reference",
                                    "Videos sent to the engine by a reference kept from an earlier encode: no decode, no encoder round")
# Video decoder processes (gateway/intake/video/decoders.py) ended during a job: "killed" (past its deadline,
# or out of step), "cancelled" (its request ended, and the decoder did not answer its stop in time) or
# "died" (a crash inside FFmpeg, the kernel's OOM killer). A stop answered in time keeps its decoder.
VIDEO_DECODERS_ENDED = Counter("prism_gateway_video_decoders_ended",
                               "Video decoder processes ended during a job: killed (past its deadline), cancelled (its "
                               "request ended and it did not stop in time) or died (a crash)", ["reason"])
for _reason in ("killed", "cancelled", "died"):
    VIDEO_DECODERS_ENDED.labels(_reason)  # exported at 0 before the first
# The memory budget (gateway/intake/memory.py): what it admits, and what requests hold of it now.
MEMORY_BUDGET = Gauge("prism_gateway_memory_budget_bytes", "Bytes requests may hold in the gateway (its memory budget)",
                      multiprocess_mode="livesum")
MEMORY_HELD = Gauge("prism_gateway_memory_held_bytes",
                    "Bytes held by requests against the memory budget: bodies, images, decodes, replies waiting",
                    multiprocess_mode="livesum")
PEER_BYTES = Counter("prism_gateway_peer_bytes", "Bytes on the gateway's sockets to encoders and engines (headers and frames)",
                     ["peer", "direction"])


# In PROMETHEUS_MULTIPROC_DIR: the polled services' metrics as the first worker
# exports them. Every worker answers scrapes with these, not with its own polls:
# two scrapes answered by different workers would otherwise see sums from polls a
# stats interval apart, and a sum that falls reads as a reset.
SERVICES_FILE = "services.prom"


def exposition(service_stats, fresh_s: float) -> bytes:
    """One scrape: this process's metrics, or every worker's (multiprocess
    mode), plus the polled services' once: the first worker's, published within
    `fresh_s`. Past that (the first worker is busy, hung or being replaced), the
    gauges are this worker's own polls (`service_stats`) and the counters and
    histograms stay as last published: this worker's sums may be lower (its polls
    are its own, and so are the gone replicas it counted), and a counter that falls
    reads as a reset. With nothing published yet, all of it is this worker's."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return generate_latest(REGISTRY)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry) + _services_part(service_stats, fresh_s)


def _services_part(service_stats, fresh_s: float) -> bytes:
    path = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]) / SERVICES_FILE
    try:
        age_s = time.time() - path.stat().st_mtime
        published = path.read_bytes()
    except FileNotFoundError:
        return _services_exposition(service_stats)
    if age_s <= fresh_s:
        return published
    gauges = [family for family in service_stats.collect() if family.type == "gauge"]
    rest = [family for family in text_string_to_metric_families(published.decode()) if family.type != "gauge"]
    return _services_exposition(_Families([*gauges, *rest]))


class _Families:
    """A collector of metric families already made."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return self.families


def publish_services(service_stats) -> None:
    """The first worker, after each poll: its services' metrics for every worker's scrapes."""
    path = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]) / SERVICES_FILE
    written = path.with_name(f"{SERVICES_FILE}.{os.getpid()}")
    written.write_bytes(_services_exposition(service_stats))
    os.replace(written, path)  # a scrape reads the old file or the new, never half of one


def _services_exposition(service_stats) -> bytes:
    registry = CollectorRegistry()
    registry.register(service_stats)
    return generate_latest(registry)


def image_size_bucket(width: int, height: int) -> str:
    megapixels = width * height / 1e6
    return next(label for bound, label in IMAGE_SIZE_BUCKETS if megapixels <= bound)


def observe(timer, ok: bool) -> None:
    """Record one finished request's timings: its TTFT once it had a first token (as vLLM counts
    it: a stream that failed or was dropped later still had one), the rest when it succeeded."""
    if timer.ttft_s is not None:
        TTFT_SECONDS.observe(timer.ttft_s)
    if not ok:
        return
    if (unaccounted := timer.unaccounted_s) is not None:  # an answer always has a first token
        for stage, seconds in (*timer.stages.items(), ("unaccounted", max(0.0, unaccounted))):
            if ran(stage, seconds):
                STAGE_SECONDS.labels(stage).observe(seconds)
    if (tpot := timer.tpot_s) is not None:
        TPOT_SECONDS.observe(tpot)
    for gap in timer.inter_token_gaps():
        ITL_SECONDS.observe(gap)
    if timer.finished_at is not None:
        E2E_SECONDS.observe(timer.finished_at - timer.arrived)
    if timer.visual_tokens:  # images', videos', or both
        VISUAL_TOKENS.observe(timer.visual_tokens)
    for width, height in timer.image_sizes:
        IMAGES.labels(image_size_bucket(width, height)).inc()


class ServiceStatsCollector:
    """Exports the latest stats the gateway polled from the encoders and engines.
    Figures are summed over models and replicas; `prism_encoder_replica_*` and
    `prism_engine_replica_*` show each replica (labelled by model)."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway

    def collect(self):
        encoders, engines = self.gateway.service_stats()
        in_flight = GaugeMetricFamily("prism_service_in_flight_requests", "Requests in flight inside each service", labels=["service"])
        queue = GaugeMetricFamily("prism_queue_depth", "Work waiting in each service (encoder: images; engine: requests with no token yet)", labels=["service"])
        if encoders:
            in_flight.add_metric(["encoder"], sum(e.in_flight for e in encoders))
            queue.add_metric(["encoder"], sum(e.queue_depth for e in encoders))
            yield from _encoder_metrics(encoders)
        if engines:
            in_flight.add_metric(["engine"], sum(e.in_flight for e in engines))
            queue.add_metric(["engine"], sum(e.waiting for e in engines))
            yield CounterMetricFamily("prism_engine_steps", "vLLM engine-core steps seen (the stall watchdog's progress signal)", value=sum(e.steps for e in engines))
            yield from _handoff_metrics(encoders, engines)
        stalls = CounterMetricFamily("prism_stalls", "Stalls each service's watchdog declared (engine: no step; encoder: a batch far past its prediction)", labels=["service"])
        displaced = CounterMetricFamily("prism_displaced_requests", "Requests refused from a service's full queue for more urgent ones (429 displaced)", labels=["service"])
        for service, stats in (("encoder", encoders), ("engine", engines)):
            stalls.add_metric([service], sum(s.stalls for s in stats))
            displaced.add_metric([service], sum(s.displaced for s in stats))
        yield stalls
        yield displaced
        yield from _replica_metrics(self.gateway.pools(retiring=False))  # a reload's old pools share the labels
        yield in_flight
        yield queue


def _encoder_metrics(encoders: list):
    def total(field: str) -> int:
        return sum(getattr(e, field) for e in encoders)

    yield GaugeMetricFamily("prism_cache_bytes", "Visual-token cache bytes in use", value=total("cache_bytes"))
    yield GaugeMetricFamily("prism_cache_capacity_bytes", "Visual-token cache capacity", value=total("cache_capacity_bytes"))
    yield GaugeMetricFamily("prism_encoder_queue_bytes", "Pixels the encoders' waiting work holds (encoder.max_queue_bytes)",
                            value=total("queue_bytes"))
    events = CounterMetricFamily("prism_cache_events", "Visual-token cache events (local tier)", labels=["event"])
    for event, field in (("hit", "cache_hits"), ("miss", "cache_misses"), ("join", "cache_joins"), ("eviction", "cache_evictions"), ("collision", "cache_collisions")):
        events.add_metric([event], total(field))
    yield events
    yield CounterMetricFamily("prism_encoder_jobs_dropped", "Queued encodes dropped: every request waiting on them went away", value=total("jobs_dropped"))
    yield CounterMetricFamily("prism_encoder_oom_splits", "Encoder batches split in two for want of device memory", value=total("oom_splits"))
    yield _histogram("prism_encoder_batch_images", "Images per encoder batch",
                     merge_histograms([e.batch_images for e in encoders], BATCH_IMAGE_BUCKETS))
    yield _histogram("prism_encoder_batch_patches", "ViT patches per encoder batch",
                     merge_histograms([e.batch_patches for e in encoders], BATCH_PATCH_BUCKETS))
    shared = [e.shared_cache for e in encoders if e.shared_cache is not None]
    if shared:
        shared_events = CounterMetricFamily("prism_shared_cache_events", "Shared (Redis) cache tier events", labels=["event"])
        for event, field in (("hit", "hits"), ("miss", "misses"), ("corrupt", "corrupt"), ("collision", "collisions"),
                             ("error", "errors"), ("write", "writes"), ("write_skipped", "writes_skipped"),
                             ("reattach", "reattaches")):
            shared_events.add_metric([event], sum(getattr(t, field) for t in shared))
        yield shared_events


def _handoff_metrics(encoders: list, engines: list):
    """Visual tokens going from encoders to engines by reference (llm_engine/images.py)."""
    images = CounterMetricFamily("prism_engine_embeddings", "Images' visual tokens an engine needed, by where it found them", labels=["source"])
    images.add_metric(["engine_cache"], sum(e.embedding_cache_hits for e in engines))
    images.add_metric(["fetched"], sum(e.embeddings_fetched for e in engines))
    images.add_metric(["joined"], sum(e.embedding_fetch_joins for e in engines))
    images.add_metric(["pushed"], sum(e.embeddings_pushed for e in engines))
    yield images
    yield CounterMetricFamily("prism_engine_fetched_bytes", "Bytes on the engines' sockets to encoders (headers and tensors)", value=sum(e.fetched_bytes for e in engines))
    yield CounterMetricFamily("prism_engine_pushed_bytes", "Visual-token bytes encoders pushed to engines unasked", value=sum(e.pushed_bytes for e in engines))
    pushes = CounterMetricFamily("prism_encoder_pushes", "New images' tokens an encoder sent to its request's engine unasked, by outcome", labels=["outcome"])
    pushes.add_metric(["sent"], sum(e.pushes for e in encoders))
    pushes.add_metric(["refused"], sum(e.push_refusals for e in encoders))  # not connected yet, or queue full: fetched
    yield pushes
    yield CounterMetricFamily("prism_encoder_fetch_misses", "Fetches of tokens an encoder no longer held (the gateway re-encodes them)", value=sum(e.fetch_misses for e in encoders))
    yield CounterMetricFamily("prism_encoder_pins_dropped", "Tokens pinned for an engine's fetch let go early, past encoder.handoff_max_mb", value=sum(e.pins_dropped for e in encoders))


def _replica_metrics(pools):
    labels = ["model", "replica"]
    families = {
        "up": GaugeMetricFamily("prism_encoder_replica_up", "1 while the encoder replica answers its heartbeat", labels=labels),
        "encoded": CounterMetricFamily("prism_encoder_replica_images_encoded", "Images each encoder replica encoded (since its start)", labels=labels),
        "shared_up": GaugeMetricFamily("prism_shared_cache_up", "1 while the encoder replica reaches the shared cache tier", labels=labels),
        "engine_up": GaugeMetricFamily("prism_engine_replica_up", "1 while the engine replica answers its heartbeat", labels=labels),
        "state": GaugeMetricFamily("prism_replica_state", "1 for the state each replica last reported (serving, draining, stalled, dead)", labels=["service", *labels, "state"]),
    }
    for model, encoders, engines in pools:
        for index, replica in encoders.serving():
            label = [model, str(index)]
            families["up"].add_metric(label, int(replica.up))
            if replica.stats is not None:
                families["encoded"].add_metric(label, replica.stats.images_encoded)
                if replica.stats.shared_cache is not None:
                    families["shared_up"].add_metric(label, int(replica.stats.shared_cache.up))
            _add_state(families["state"], "encoder", label, replica.stats)
        for index, replica in engines.serving():
            label = [model, str(index)]
            families["engine_up"].add_metric(label, int(replica.up))
            _add_state(families["state"], "engine", label, replica.stats)
    yield from families.values()


def _add_state(family: GaugeMetricFamily, service: str, label: list[str], stats) -> None:
    if stats is not None:
        for state in ServiceState:
            family.add_metric([service, *label, state.name.lower()], int(stats.state == state))


def merge_histograms(snapshots: list[HistogramSnapshot], bounds: tuple[float, ...]) -> HistogramSnapshot:
    """One histogram of `bounds` from the snapshots that have them (one per replica): a replica
    of another version, with other buckets, is left out rather than read against the wrong ones."""
    same = [s for s in snapshots if tuple(s.bounds) == tuple(bounds)]
    counts = [sum(column) for column in zip(*(s.counts for s in same))] or [0] * (len(bounds) + 1)
    return HistogramSnapshot(tuple(bounds), tuple(counts), sum(s.total for s in same))


def _histogram(name: str, documentation: str, snapshot) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, buckets=snapshot.cumulative(), sum_value=snapshot.total)
