"""The load tester end to end against the session's Prism stack: a short mixed
run over data URLs (streaming) and over fetched URLs (not streaming), and a
tiny mix of clips (short and long, new and repeated) with images."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadtest import report
from loadtest.bench import Plan, load_test, sweep
from loadtest.client import Target
from loadtest.runner import Arrival, image_urls, run
from loadtest.stats import SLO, by_bucket
from loadtest.videos import VideoMix, parse_lengths
from loadtest.workload import WorkloadSpec, generate, parse_buckets
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
    assert 0 < timed["summary"]["completed"] < 200
    # a target with nothing listening: every request fails, counted by kind
    dead = load_test(Target("http://127.0.0.1:9", MODEL_NAME, timeout_s=5), SPEC, Arrival(rate=20), Plan(requests=3, warmup=0, progress=False))
    assert dead["summary"]["completed"] == 0 and sum(dead["summary"]["errors"].values()) == 3


VIDEO_SPEC = WorkloadSpec(parse_buckets("224x224=1"), max_tokens=4, seed=20,  # a seed that sends every kind, and one clip twice with one question
                          videos=VideoMix(parse_lengths("2s=1,3s=1"), fraction=0.6, repeat_ratio=0.5, pool_size=2,
                                          width=96, height=64, source_fps=4.0, sample_fps=2.0))


def test_a_video_mix_reports_ttft_per_kind_and_a_repeated_clip_costs_the_same_tokens(stack):
    target = Target(stack.base_url, MODEL_NAME)
    requests = generate(VIDEO_SPEC, 10)
    with image_urls(requests, "data") as urls_of:
        outcome = asyncio.run(run(target, requests, urls_of, Arrival(concurrency=2)))
    assert all(r.ok for r in outcome.results), [r.error for r in outcome.results]
    sent = {request.index: request for request in requests}
    tokens_of_ask: dict = {}  # (clip, question) → prompt-token counts: a repeat costs what the first did
    for result in outcome.results:
        for clip in sent[result.index].videos:
            tokens_of_ask.setdefault((clip, sent[result.index].question), []).append(result.prompt_tokens)
    assert any(len(tokens) > 1 for tokens in tokens_of_ask.values())
    assert all(len(set(tokens)) == 1 for tokens in tokens_of_ask.values()), tokens_of_ask
    kinds = by_bucket(outcome.results, outcome.duration_s)
    assert set(kinds) == {"224x224", "video-2s-new", "video-2s-repeat", "video-3s-new", "video-3s-repeat"}
    assert all(kinds[k]["median_ttft_ms"] > 0 for k in kinds)
    # Every clip is decoded by the gateway, in the breakdown of one of the requests that sent it. Not
    # always its first: at concurrency 2 a repeat sent with the clip's first request may reach the
    # hand-off before it, and the first then joins its encode without a decode.
    decodes_of_clip: dict = {}
    for result in outcome.results:
        for clip in sent[result.index].videos:
            decodes_of_clip.setdefault(clip, []).append(result.stages_ms.get("video_decode", 0.0))
    assert decodes_of_clip and all(max(ms) > 0 for ms in decodes_of_clip.values()), decodes_of_clip
