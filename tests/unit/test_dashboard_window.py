"""The numbers /dashboard draws (gateway/ops/dashboard.py): a stacked bar must add up to the
TTFT it stands for, and throughput must count requests answered, at any rate."""

from __future__ import annotations

import time

import pytest

from gateway.ops.dashboard import DashboardWindow
from gateway.timing import STAGES
from protocol.siblings import FinishedRequest


def request(at: float, ok: bool = True, **stages_ms: float) -> FinishedRequest:
    stages = dict.fromkeys(STAGES, 0.0) | stages_ms
    ttft = sum(stages.values())
    return FinishedRequest(at=at, ok=ok, stages_ms=stages if ok else {}, ttft_ms=ttft if ok else None, tpot_ms=None,
                           cache_hits=0, cache_misses=1)


def test_each_percentile_s_bar_is_the_stages_of_the_requests_at_that_ttft():
    """60 % of the requests wait 200 ms for the engine, 40 % spend 300 ms encoding. Each stage's
    own p95 (200 + 300) adds up to a TTFT no request had; the bar at the p95 is the encodes'."""
    window, now = DashboardWindow(), time.time()
    for i in range(100):
        window.add(request(now, engine_queue=200.0) if i % 5 < 3 else request(now, encode=300.0))
    snapshot = window.snapshot()
    assert snapshot["stages"]["engine_queue"]["p95"] + snapshot["stages"]["encode"]["p95"] == 500
    p95, p50 = snapshot["breakdown"]["p95"], snapshot["breakdown"]["p50"]
    assert (p95["ttft"], p95["stages"]["encode"], p95["stages"]["engine_queue"]) == (300, 300, 0)
    assert (p50["ttft"], p50["stages"]["engine_queue"]) == (200, 200)
    for bar in (p50, p95):
        assert sum(bar["stages"].values()) == pytest.approx(bar["ttft"])


def test_a_stage_s_own_percentiles_are_over_the_requests_it_ran_in():
    """Two requests in a hundred decode a video: video_decode's p95 is theirs, not the zeros of
    the 98 that had none, and the table says how few requests ran it; a stage none ran has no
    percentiles. The bars still take every request, so they add up."""
    window, now = DashboardWindow(), time.time()
    for i in range(100):
        window.add(request(now, video_decode=400.0, prefill=50.0) if i < 2 else request(now, prefill=50.0, unaccounted=0.0))
    stages = window.snapshot()["stages"]
    assert stages["video_decode"] == {"p50": 400.0, "p95": 400.0, "ran": 0.02}
    assert stages["image_fetch"] == {"p50": None, "p95": None, "ran": 0.0}
    assert stages["unaccounted"] == {"p50": 0.0, "p95": 0.0, "ran": 1.0}  # the remainder: every request's
    assert window.snapshot()["breakdown"]["p50"]["stages"]["video_decode"] == 0


def test_throughput_counts_every_answer_and_no_refusal_past_the_kept_records():
    window, now = DashboardWindow(span_s=10, bucket_s=5, max_records=100), time.time()
    window.started = now - 60  # older than its span
    for i in range(800):
        window.add(request(now - i / 100))  # 100 answered a second for the last 8 s of the 10
    for _ in range(50):
        window.add(request(now, ok=False))
    snapshot = window.snapshot()
    assert (snapshot["requests"], snapshot["errors"]) == (850, 50)
    assert snapshot["throughput_rps"] == 80
    assert sum(point["rps"] * 5 for point in snapshot["series"]) == pytest.approx(800)
    assert len(window.records) == 100


def test_a_window_younger_than_its_span_divides_by_its_age():
    """A worker (re)started a minute ago has a minute of requests, not five."""
    window, now = DashboardWindow(span_s=300), time.time()
    window.started = now - 60
    for i in range(120):
        window.add(request(now - i / 2))  # 2 answered a second for the minute
    assert window.snapshot()["throughput_rps"] == pytest.approx(2, rel=0.02)


def test_an_empty_window_draws_no_bar():
    assert DashboardWindow().snapshot()["breakdown"] == {"p50": None, "p95": None}


def test_counts_keep_to_the_window_with_no_one_looking_and_take_late_records():
    """Each request adds to its second's count; seconds past the window go as new ones come,
    not only when /dashboard/data is read. Another worker's record may come after a later one."""
    window, start = DashboardWindow(span_s=10), int(time.time()) - 100  # whole seconds: start + 95.5 is in second start + 95
    for i in range(100):
        window.add(request(start + i))
    assert len(window.counts) <= 12
    window.add(request(start + 95.5))  # late, into a second still held
    window.add(request(start + 50))  # late, past the window: forgotten with the rest
    assert sum(slot[0] for _, slot in window.counts if _ == int(start + 95)) == 2
    assert [at for at, _ in window.counts] == sorted(at for at, _ in window.counts)


def test_a_view_is_a_copy_that_a_thread_summarises_while_requests_keep_arriving():
    """The summary of a full window takes the better part of a second: the gateway takes a view on
    its loop and summarises it on a thread, so the window must go on taking requests meanwhile."""
    import threading

    window, now = DashboardWindow(), time.time()
    for _ in range(1000):
        window.add(request(now, encode=5.0))
    view = window.view()
    summaries: list[dict] = []
    summarising = threading.Thread(target=lambda: summaries.extend(view.summary() for _ in range(20)))
    summarising.start()
    while summarising.is_alive():
        window.add(request(time.time(), encode=5.0))  # as the loop does, while the thread reads
    summarising.join()
    assert {summary["requests"] for summary in summaries} == {1000}
    assert window.snapshot()["requests"] > 1000
