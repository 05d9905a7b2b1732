"""Every Prometheus metric Prism exports, defined in one place.

Units are seconds; labels are few. Encoder and engine stages are reported in
their replies, so one scrape of the gateway shows the whole decomposition.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# ms to tens of seconds: CPU demo and GPU deployments both land inside.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)

REQUESTS = Counter("prism_requests_total", "Chat completion requests by HTTP status", ["status"])
STAGE_SECONDS = Histogram("prism_stage_seconds", "Per-stage share of time to first token", ["stage"], buckets=LATENCY_BUCKETS)
TTFT_SECONDS = Histogram("prism_ttft_seconds", "Request arrival to first token sent", buckets=LATENCY_BUCKETS)
E2E_SECONDS = Histogram("prism_e2e_seconds", "Request arrival to last byte", buckets=LATENCY_BUCKETS)
CACHE_LOOKUPS = Counter("prism_cache_lookups_total", "Visual-token cache lookups by result", ["result"])
IMAGES = Counter("prism_images_total", "Images accepted by the gateway")


def observe(timer) -> None:
    """Record one finished request's timings."""
    for stage, seconds in timer.stages.items():
        STAGE_SECONDS.labels(stage).observe(seconds)
    if timer.ttft_s is not None:
        TTFT_SECONDS.observe(timer.ttft_s)
    if timer.finished_at is not None:
        E2E_SECONDS.observe(timer.finished_at - timer.arrived)
    CACHE_LOOKUPS.labels("hit").inc(timer.cache_hits)
    CACHE_LOOKUPS.labels("miss").inc(timer.cache_misses)
