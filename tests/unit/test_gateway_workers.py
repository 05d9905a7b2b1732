"""What keeps several gateway workers one gateway: the feed of finished
requests between their dashboard windows, and one scrape summing every
worker's metrics (prometheus-client's multiprocess mode, run in child
processes: the mode is chosen when prometheus_client is imported)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import zmq.asyncio

from common.config import REPO_ROOT
from gateway.ops import metrics
from gateway.ops.workers import WorkerSlot
from gateway.ops.dashboard import DashboardWindow, finished_request
from gateway.ops.siblings import Siblings
from gateway.timing import RequestTimer
from tests.waiting import wait_until_async


def test_each_workers_window_holds_every_workers_requests(tmp_path):
    async def run():
        ctx = zmq.asyncio.Context()
        windows = [DashboardWindow() for _ in range(3)]
        workers = [Siblings(ctx, tmp_path, WorkerSlot(i, 3), windows[i]) for i in range(3)]
        try:
            def every_worker_hears_the_others() -> bool:
                for index, worker in enumerate(workers):
                    worker.load(index + 1)  # said again until heard: a PUB drops all until a subscription has arrived
                return all(len(w.loads) == 2 for w in workers)

            await wait_until_async(every_worker_hears_the_others, 10, "every worker hearing the other two", every_s=0.05,
                                   observe=lambda: [w.loads for w in workers])
            for index, worker in enumerate(workers):
                timer = RequestTimer()
                timer.mark_first_token()
                record = finished_request(timer, ok=True)
                windows[index].add(record)  # as Gateway.finished does
                worker.finished(record)
            await wait_until_async(lambda: all(len(w.records) == 3 for w in windows), 10, "every worker's request in every window",
                                   observe=lambda: [len(w.records) for w in windows])
            assert [w.in_flight_elsewhere for w in workers] == [5, 4, 3]  # the others' loads: 2+3, 1+3, 1+2
        finally:
            for worker in workers:
                await worker.close()
            ctx.term()

    asyncio.run(run())


WORKER = textwrap.dedent("""
    import sys
    from gateway.ops import metrics
    metrics.REQUESTS.labels("200", "ok").inc(int(sys.argv[1]))
    metrics.IN_FLIGHT.labels("gateway").set(int(sys.argv[1]))
    metrics.REPLICA_REQUESTS["engine"].labels("m", "0").inc()
""")
SCRAPE = textwrap.dedent("""
    from gateway.ops import metrics
    class Polled:
        def collect(self):
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
            yield GaugeMetricFamily("prism_polled", "from the services", value=7)
            yield CounterMetricFamily("prism_polled_events", "from the services", value=50)
    print(metrics.exposition(Polled(), fresh_s=5.0).decode())
""")


def test_one_scrape_sums_every_workers_metrics_and_drops_a_dead_workers_gauges(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}

    def python(code: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=True)

    python(WORKER, "3")
    python(WORKER, "4")
    scraped = python(SCRAPE).stdout
    assert 'prism_requests_total{reason="ok",status="200"} 7.0' in scraped
    assert 'prism_engine_replica_requests_total{model="m",replica="0"} 2.0' in scraped
    assert 'prism_in_flight_requests{service="gateway"} 7.0' in scraped  # livesum: both pids count (none marked dead)
    assert "prism_polled 7.0" in scraped
    pids = sorted(int(name.split("_")[-1].removesuffix(".db")) for name in os.listdir(tmp_path) if name.startswith("gauge_livesum_"))
    python(f"from prometheus_client import multiprocess; multiprocess.mark_process_dead({pids[0]}, {str(tmp_path)!r})")
    after = python(SCRAPE).stdout
    assert 'prism_requests_total{reason="ok",status="200"} 7.0' in after  # a dead worker's requests still count
    assert 'prism_in_flight_requests{service="gateway"} 3.0' in after or 'prism_in_flight_requests{service="gateway"} 4.0' in after


PUBLISH = textwrap.dedent("""
    from gateway.ops import metrics
    class Polled:
        def collect(self):
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
            yield GaugeMetricFamily("prism_polled", "from the services", value=9)
            yield CounterMetricFamily("prism_polled_events", "from the services", value=100)
    metrics.publish_services(Polled())
""")


def test_every_worker_scrapes_the_first_worker_s_services_while_it_publishes_them(tmp_path):
    """The services' part of any worker's scrape is what the first worker published. Once that is
    older than `fresh_s` (the first worker died and its successor has not polled), the gauges are a
    worker's own, and the counters stay as published: this worker's lower sum would read as a reset."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}

    def python(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout

    assert "prism_polled_events_total 50.0" in python(SCRAPE)  # nothing published yet: its own
    python(PUBLISH)
    fresh = python(SCRAPE)
    assert "prism_polled 9.0" in fresh and "prism_polled_events_total 100.0" in fresh
    published = tmp_path / metrics.SERVICES_FILE
    os.utime(published, (published.stat().st_atime, published.stat().st_mtime - 60))
    stale = python(SCRAPE)
    assert "prism_polled 7.0" in stale and "prism_polled_events_total 100.0" in stale
    assert stale.count("# TYPE prism_polled_events_total counter") == 1
