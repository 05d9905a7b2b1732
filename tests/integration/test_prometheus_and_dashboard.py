"""A real Prometheus server scrapes the gateway, the shipped configs check out,
and the built-in dashboard renders real numbers in headless Chromium."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from gateway.timing import STAGES
from common.config import REPO_ROOT
from testing.stack import free_port
from loadtest.synthetic import make_image
from tests.integration.conftest import MODEL_NAME
from tests.integration.corpus import b64, save
from tests.integration.helpers import wait_until
from tests.integration.system import binary

CONFIGS = REPO_ROOT / "configs"


def traffic(stack, n: int = 6) -> None:
    """Some misses and some hits, streaming and not."""
    for i in range(n):
        url = b64(save(make_image(f"dash-{i % 3}", (320, 240)), "PNG"))
        payload = {"model": MODEL_NAME, "max_tokens": 4, "stream": i % 2 == 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}
        assert httpx.post(f"{stack.base_url}/v1/chat/completions", json=payload, timeout=60).status_code == 200


def test_shipped_prometheus_config_passes_promtool():
    result = subprocess.run([binary("promtool"), "check", "config", str(CONFIGS / "prometheus.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prometheus")
    config = (CONFIGS / "prometheus.yml").read_text()
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s").replace("gateway:8000", urlsplit(stack.base_url).netloc)
    (workdir / "prometheus.yml").write_text(config)
    port = free_port()
    process = subprocess.Popen(
        [binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=open(workdir / "prometheus.log", "wb"), stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # It listens some milliseconds after it starts: a query before that is refused, not an empty answer.
        wait_until(lambda: answers_ready(url, process), 60, "Prometheus ready", 0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def answers_ready(url: str, process: subprocess.Popen) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"Prometheus exited with {process.returncode} (its prometheus.log says why)")
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(prometheus: str, promql: str) -> dict:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def stages_scraped(prometheus: str) -> set[str]:
    result = query(prometheus, "sum by (stage) (prism_stage_seconds_count)")["data"]["result"]
    return {r["metric"]["stage"] for r in result if float(r["value"][1]) > 0}


# The stages `traffic` runs: all but the videos' (a stage is observed where it ran).
IMAGE_STAGES = {stage for stage in STAGES if not stage.startswith("video_")}


def test_prometheus_scrapes_every_stage(stack, prometheus):
    traffic(stack)
    wait_until(lambda: stages_scraped(prometheus) >= IMAGE_STAGES, 60, "Prometheus holding every stage images run", 1,
               observe=lambda: stages_scraped(prometheus))
    exported = query(prometheus, "prism_stage_seconds_count")["data"]["result"]
    assert {r["metric"]["stage"] for r in exported} == set(STAGES)  # the video stages too, at 0 until a video comes
    # traffic's repeats went to the engine by the references the gateway kept (gateway/routing/handoff.py)
    hits = query(prometheus, "prism_gateway_images_by_known_reference_total")["data"]["result"]
    assert hits and float(hits[0]["value"][1]) > 0


def test_every_grafana_panel_query_is_valid_promql_over_series_prism_exports(stack, prometheus):
    """Valid alone proves little: a query of a metric renamed since is valid, and draws nothing."""
    dashboard = json.loads((CONFIGS / "grafana" / "prism-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(dashboard["panels"]) >= 8
    for expr in exprs:
        assert query(prometheus, expr.replace("$__rate_interval", "1m"))["status"] == "success", expr
    traffic(stack)
    # exported only where encoders have a shared tier (test_replicas.py's stack reads it; this one has none)
    asked = {name for expr in exprs for name in re.findall(r"\bprism_[a-z0-9_]+", expr)} - {"prism_shared_cache_events_total"}
    scraped = lambda: set(httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"])  # noqa: E731
    wait_until(lambda: asked <= scraped(), 60, "every series the dashboard asks for scraped", 1, observe=lambda: asked - scraped())


def test_dashboard_renders_real_numbers(stack, tmp_path):
    traffic(stack)
    wait_until(lambda: httpx.get(f"{stack.base_url}/dashboard/data", timeout=10).json()["services"], 30,
               "a series for the service panels (two stats polls)")
    chromium = binary("chromium")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=8000"]
    url = f"{stack.base_url}/dashboard"
    dom = subprocess.run([chromium, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert 'data-ready="1"' in dom, dom[:2000]
    for stage in IMAGE_STAGES:
        cell = dom.split(f'data-stage="{stage}" data-q="p50">', 1)[1].split("<", 1)[0]
        assert float(cell) >= 0, (stage, cell)
    ran = dom.split('data-stage="encode" data-q="ran">', 1)[1].split("<", 1)[0]
    assert ran.endswith("%") and 0 < float(ran[:-1]) <= 100  # misses encode, repeats do not
    assert float(dom.split('data-stage="encode" data-q="p95">', 1)[1].split("<", 1)[0]) > 0
    hit_rate = dom.split('id="cache-hit-rate">', 1)[1].split("<", 1)[0]
    assert hit_rate.endswith("%") and 0 < float(hit_rate[:-1]) < 100
    screenshot = tmp_path / "dashboard.png"
    subprocess.run([chromium, *flags, "--window-size=1400,1100", f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
    assert screenshot.exists() and screenshot.stat().st_size > 10_000
    Path(REPO_ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (REPO_ROOT / "bench" / "results" / "dashboard.png").write_bytes(screenshot.read_bytes())
