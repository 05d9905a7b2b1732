"""The load tester end to end against the session's Prism stack: a short mixed
run over data URLs (streaming) and over fetched URLs (not streaming)."""

from __future__ import annotations

import json

import pytest

from loadtest import report
from loadtest.bench import Plan, load_test, sweep
from loadtest.client import Target
from loadtest.runner import Arrival
from loadtest.stats import SLO
from loadtest.workload import WorkloadSpec, parse_buckets
from tests.integration.conftest import ALLOWED_LOOPBACK, MODEL_NAME

SPEC = WorkloadSpec(parse_buckets("224x224=1,448x336=1,640x160=1"), repeat_ratio=0.5, pool_size=4, png_fraction=0.3,
                    max_tokens=6, system_prompts="unique", seed=11)


def test_a_short_streaming_run_reports_everything(stack, tmp_path):
    target = Target(stack.base_url, MODEL_NAME)
    result = load_test(target, SPEC, Arrival(concurrency=3), Plan(requests=9, warmup=1, progress=False), SLO(ttft_ms=60_000))
    summary = result["summary"]
    assert (summary["completed"], summary["failed"]) == (9, 0)
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])  # a generous SLO: all good
    assert 0 < summary["median_ttft_ms"] <= summary["median_e2el_ms"]
    assert summary["total_output_tokens"] > 0 and summary["mean_tpot_ms"] > 0
    assert sum(b["completed"] for b in result["by_bucket"].values()) == 9
    assert result["stages"] and all("encode" in stages and "prefill" in stages for stages in result["stages"].values())
    files = report.write(result, tmp_path)
    assert json.loads(files[0].read_text())["summary"]["completed"] == 9
    assert "| all |" in files[1].read_text()
    assert all(path.stat().st_size > 1000 and path.read_bytes().startswith(b"\x89PNG") for path in files[2:])


def test_fetched_urls_without_streaming_and_a_tiny_sweep(stack, tmp_path):
    target = Target(stack.base_url, MODEL_NAME, stream=False)
    plan = Plan(requests=4, warmup=0, transport="url", image_host=ALLOWED_LOOPBACK, progress=False)
    result = sweep(target, SPEC, [1, 2], "concurrency", plan, SLO(ttft_ms=60_000))
    assert [p["summary"]["completed"] for p in result["points"]] == [4, 4]
    assert result["best_load"] == 2
    # bounded by time: far fewer than the 200 requests it may send
    timed = load_test(target, SPEC, Arrival(concurrency=2), Plan(requests=200, duration_s=1.5, warmup=0, progress=False))
    assert 0 < timed["summary"]["completed"] < 200 and timed["summary"]["duration"] < 30
    # a target with nothing listening: every request fails, counted by kind
    dead = load_test(Target("http://127.0.0.1:9", MODEL_NAME, timeout_s=5), SPEC, Arrival(rate=20), Plan(requests=3, warmup=0, progress=False))
    assert dead["summary"]["completed"] == 0 and sum(dead["summary"]["errors"].values()) == 3
