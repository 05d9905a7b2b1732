"""Per-request TTFT decomposition, request ids in every service's logs,
Server-Timing, and the metrics a scrape of the gateway shows."""

from __future__ import annotations

import json
from functools import partial

import httpx
import pytest

from gateway.timing import TTFT_STAGES
from loadtest.synthetic import make_image
from tests.integration.conftest import MODEL_NAME
from tests.integration.corpus import b64, save
from tests.integration.helpers import log_records, scrape, wait_until

TOLERANCE_MS = 1.0  # rounding of each stage to µs, and nothing else


def body(url: str, stream: bool) -> dict:
    return {
        "model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "stream": stream,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}],
    }


def breakdown(stack, url: str, stream: bool) -> dict:
    if not stream:
        response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(url, False), timeout=60)
        assert response.status_code == 200
        return response.json()["prism"]
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body(url, True), timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    final = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    return final[-1]["prism"]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_stages_add_up_to_ttft_on_miss_and_hit(stack, stream):
    url = b64(save(make_image(f"sum-{stream}", (480, 360)), "PNG"))
    for expected_cache in ({"hits": 0, "misses": 1}, {"hits": 1, "misses": 0}):
        result = breakdown(stack, url, stream)
        stages = result["stages_ms"]
        assert result["cache"] == expected_cache
        assert all(stages[s] >= 0 for s in TTFT_STAGES)
        total = sum(stages[s] for s in TTFT_STAGES) + stages["unaccounted"]
        assert abs(total - stages["ttft"]) <= TOLERANCE_MS
        assert stages["unaccounted"] >= 0
        assert stages["e2e"] >= stages["ttft"] > 0
        if expected_cache["misses"]:
            assert stages["encode"] > 0 and stages["prefill"] > 0 and stages["image_preprocess"] > 0


def test_server_timing_header_carries_every_stage(stack):
    url = b64(save(make_image("server-timing", (200, 150)), "PNG"))
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(url, False), timeout=60)
    header = response.headers["server-timing"]
    entries = dict(e.strip().split(";", 1) for e in header.split(","))
    for stage in (*TTFT_STAGES, "unaccounted", "ttft", "e2e"):
        assert entries[stage].startswith("dur=") and float(entries[stage][4:]) >= 0
    assert entries["cache"] == 'desc="hits=0 misses=1"'
    assert float(entries["ttft"][4:]) == response.json()["prism"]["stages_ms"]["ttft"]


def services_logging(stack, request_prefix: str) -> set[str]:
    return {line["service"] for line in log_records(stack, request_prefix=request_prefix)}


def test_client_request_id_is_echoed_and_in_every_services_logs(stack):
    url = b64(save(make_image("trace", (160, 120)), "PNG"))
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(url, False), headers={"X-Request-Id": "trace-abc.123"}, timeout=60)
    assert response.headers["x-request-id"] == "trace-abc.123"
    logged = partial(services_logging, stack, "trace-abc.123-")
    wait_until(lambda: logged() >= {"gateway", "encoder", "engine"}, 10, "the request id in every service's log", 0.2, observe=logged)
    assert logged() == {"gateway", "encoder", "engine"}
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in log_records(stack))


def test_one_scrape_shows_every_service(stack):
    url = b64(save(make_image("scrape", (300, 200)), "PNG"))
    for _ in range(2):  # a miss, then a hit
        assert httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(url, True), timeout=60).status_code == 200
    names = (  # the stages' histograms are exported from the start (test_prometheus_and_dashboard: their counts)
        "prism_ttft_seconds_bucket", "prism_tpot_seconds_bucket", "prism_itl_seconds_bucket", "prism_e2e_seconds_bucket",
        "prism_encoder_batch_images_bucket", "prism_encoder_batch_patches_bucket", "prism_visual_tokens_per_request_bucket",
        'prism_cache_events_total{event="hit"}', 'prism_cache_events_total{event="miss"}', 'prism_cache_events_total{event="join"}',
        'prism_cache_events_total{event="eviction"}', "prism_cache_bytes", 'prism_queue_depth{service="encoder"}',
        "prism_encoder_queue_bytes",
        'prism_queue_depth{service="engine"}', 'prism_in_flight_requests{service="gateway"}', 'prism_images_total{size="le_0.25mp"}',
        'prism_requests_total{reason="ok",status="200"}',
    )

    def missing() -> list[str]:
        text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
        return [name for name in names if name not in text]

    # the services' figures come from the stats the gateway polls (every second)
    wait_until(lambda: not missing(), 10, "one scrape showing every service's metrics")
    # the loop probe samples ten times a second, requests or not
    assert scrape(stack)[("prism_gateway_loop_lag_seconds_count", ())] > 0


def test_the_gateway_counts_the_bytes_it_moves_to_and_from_each_service(stack):
    def moved() -> dict[tuple[str, str], float]:
        return {(dict(labels)["peer"], dict(labels)["direction"]): value
                for (name, labels), value in scrape(stack).items() if name == "prism_gateway_peer_bytes_total"}

    before = moved()
    url = b64(save(make_image("bytes", (320, 240)), "PNG"))
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body(url, False), timeout=60).json()
    after = moved()
    embedding_bytes = response["usage"]["prompt_tokens_details"]["image_tokens"] * 128 * 4  # hidden 128, float32 here
    # the visual tokens go from encoder to engine directly: the gateway carries a reference each way
    assert 0 < after["encoder", "received"] - before["encoder", "received"] < embedding_bytes / 4
    assert 0 < after["engine", "sent"] - before["engine", "sent"] < embedding_bytes / 4
    assert after["encoder", "sent"] - before["encoder", "sent"] >= 3 * 240 * 320 // 4  # the pixels, at most 4× downscaled
