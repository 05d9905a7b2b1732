"""The load tester's statistics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from loadtest.stats import SLO, RequestResult, by_bucket, percentile, stage_means, stage_medians, stage_percentiles, summarize


def ok(ttft: float, e2e: float, tokens: int, bucket: str = "a", itl=(), stages=None) -> RequestResult:
    return RequestResult(bucket, 0.0, ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, prompt_tokens=10,
                         itl_s=list(itl), stages_ms=stages)


RESULTS = [
    ok(0.1, 1.1, 11, itl=[0.1] * 10),
    ok(0.2, 1.2, 11, itl=[0.1] * 10),
    ok(0.3, 2.3, 11, "b", itl=[0.2] * 10),
    ok(0.4, 0.4, 1, "b"),
    RequestResult("b", 0.0, ok=False, error="http_429"),
]


def test_percentiles_interpolate_between_ranks():
    values = [100.0, 200.0, 300.0, 400.0]
    assert percentile(values, 50) == 250.0
    assert percentile(values, 90) == pytest.approx(370.0)  # rank 2.7: 300 + 0.7 × 100
    assert percentile(values, 99) == pytest.approx(397.0)
    assert math.isnan(percentile([], 50))  # no figure, never a 0 ms that reads as the fastest


def test_summary_by_hand():
    s = summarize(RESULTS, duration_s=2.0, slo=SLO(ttft_ms=250))
    assert (s["completed"], s["failed"], s["errors"]) == (4, 1, {"http_429": 1})
    assert s["request_throughput"] == 2.0
    assert s["request_goodput"] == 1.0  # ttft 100 and 200 ms meet 250 ms
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["total_output_tokens"] == 34 and s["output_throughput"] == 17.0
    assert s["total_token_throughput"] == pytest.approx((34 + 40) / 2)
    assert s["mean_ttft_ms"] == pytest.approx(250.0) and s["median_ttft_ms"] == pytest.approx(250.0)
    # TPOT: (e2e − ttft) / (tokens − 1) = 100, 100, 200 ms; the 1-token request has none
    assert s["median_tpot_ms"] == pytest.approx(100.0) and s["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert s["median_itl_ms"] == pytest.approx(100.0) and s["p99_itl_ms"] == pytest.approx(200.0)
    assert s["median_e2el_ms"] == pytest.approx(1150.0)


def test_tpot_slo_counts_too():
    s = summarize(RESULTS, duration_s=1.0, slo=SLO(ttft_ms=1000, tpot_ms=150))
    assert s["request_goodput"] == 3.0  # the 200 ms-TPOT request misses; the 1-token one has no TPOT


def test_per_bucket_and_stage_medians():
    buckets = by_bucket(RESULTS, duration_s=2.0)
    assert buckets["a"]["completed"] == 2 and buckets["b"]["completed"] == 2 and buckets["b"]["failed"] == 1
    staged = [ok(0.1, 0.2, 2, stages={"encode": e, "prefill": 1.0, "ttft": 9.0}) for e in (10.0, 30.0, 20.0)]
    assert stage_medians(staged) == {"a": {"encode": 20.0, "prefill": 1.0}}
    assert stage_medians(RESULTS) == {}


def test_a_stage_s_percentiles_are_over_the_requests_that_ran_it_and_its_means_over_all():
    """Two of three requests hit the cache (encode 0): the encode median is the miss's own, while the
    means, stacked, still add up to the mean TTFT."""
    staged = [ok(0.1, 0.2, 2, stages={"encode": e, "prefill": 10.0, "unaccounted": u, "ttft": e + 10.0 + u})
              for e, u in ((30.0, 0.0), (0.0, 2.0), (0.0, 0.0))]
    assert stage_percentiles(staged)["a"]["encode"] == {"p50": 30.0, "p90": 30.0}
    assert stage_percentiles(staged)["a"]["unaccounted"]["p50"] == 0.0  # every request's remainder counts
    means = stage_means(staged)["a"]
    assert means["encode"] == 10.0 and sum(means.values()) == pytest.approx((40 + 12 + 10) / 3)
