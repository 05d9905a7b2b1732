"""A gateway of two worker processes (`gateway.workers: 2`) in front of the
session stack's encoder and engine: both workers take connections on the one
port, one scrape counts every worker's requests, the dashboard shows them all
from either worker, the concurrency limit holds for the gateway as a whole, a
killed worker is replaced while the other keeps serving, so is a hung one,
SIGHUP reaches every worker, and SIGTERM lets a request in flight finish before all exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from common.config import REPO_ROOT
from testing.stack import free_port, wait_for_health
from loadtest.synthetic import make_image
from tests.integration.conftest import MODEL_NAME
from tests.integration.corpus import b64, save
from tests.integration.helpers import scrape, wait_until

OK = ("prism_requests_total", (("reason", "ok"), ("status", "200")))
IN_FLIGHT = ("prism_in_flight_requests", (("service", "gateway"),))


class Workers:
    def __init__(self, stack, run_dir) -> None:
        self.port = free_port()
        self.log_path = run_dir / "workers.log"
        env = dict(os.environ, PRISM_GATEWAY__WORKERS="2", PRISM_GATEWAY__MAX_CONCURRENT_REQUESTS="2",
                   PRISM_GATEWAY__PORT=str(self.port), PRISM_GATEWAY__STATS_INTERVAL_S="0.5",
                   PRISM_GATEWAY__CHILD_LIVENESS_S="3",  # judged after a probe's 5 s of silence
                   PRISM_GATEWAY__ENCODER_ADDRESSES=json.dumps(stack.encoder_addresses),
                   PRISM_GATEWAY__ENGINE_ADDRESSES=json.dumps(stack.engine_addresses))
        self.supervisor = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env=env,
                                           stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pids(self) -> set[int]:
        return {child.pid for child in psutil.Process(self.supervisor.pid).children()}

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def logged(self, prefix: str) -> set[int]:
        """The pids of the gateway processes that logged a message starting with `prefix`."""
        return {r["pid"] for r in self.records() if r.get("service") == "gateway" and r["message"].startswith(prefix)}

    def all_ready(self) -> bool:
        """Every worker serves: each said so (a worker listens only once it serves, so the port may
        answer while another still starts), and the port answers ready."""
        try:
            pids = self.pids()
            return len(pids) == 2 and pids <= self.logged("Prism ready") and all(
                httpx.get(f"{self.url}/health/ready", timeout=5).status_code == 200 for _ in range(8))
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="module")
def workers(stack, tmp_path_factory):
    gateway = Workers(stack, tmp_path_factory.mktemp("workers"))
    try:
        wait_for_health(gateway.url, gateway.supervisor, 120)
        wait_until(gateway.all_ready, 60, "both workers ready")
        yield gateway
    finally:
        if gateway.supervisor.poll() is None:  # the last test stops it itself
            running = gateway.pids()
            gateway.supervisor.terminate()
            gateway.supervisor.wait(60)
            assert not any(psutil.pid_exists(pid) for pid in running), "the supervisor left workers behind"


def chat(url: str, content, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": content}], **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)  # a new connection each time


def with_image(name: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": b64(save(make_image(name, (320, 240)), "JPEG"))}},
            {"type": "text", "text": "What is it?"}]


def test_both_workers_serve_and_one_scrape_counts_every_request(workers):
    before = scrape(workers.url).get(OK, 0.0)
    for i in range(16):
        assert chat(workers.url, with_image(f"worker-{i % 4}")).status_code == 200
    assert workers.logged("status 200") == workers.pids()  # the kernel spread the connections over both
    for _ in range(4):  # whichever worker answers the scrape, it counts both workers' requests
        assert scrape(workers.url)[OK] - before == 16
    wait_until(lambda: all(httpx.get(f"{workers.url}/dashboard/data", timeout=5).json()["requests"] >= 16 for _ in range(4)),
               10, "every worker's dashboard shows all 16 requests")


SERVICE_SUMS = [("prism_engine_steps_total", ()), ("prism_cache_events_total", (("event", "miss"),)),
                ("prism_encoder_batch_images_count", ())]


def test_scrapes_answered_by_either_worker_see_the_services_sums_only_grow(workers):
    """Each worker polls the services on its own clock; the services' part of a scrape is the
    first worker's, whichever worker answers, so a sum never falls between two scrapes (a fall
    reads as a reset, and rate() as a burst of everything counted so far)."""
    seen = []
    with ThreadPoolExecutor(1) as pool:  # one at a time: the gateway's limit here is one request per worker
        load = [pool.submit(chat, workers.url, with_image(f"sums-{i}"), max_tokens=16) for i in range(12)]
        while not all(future.done() for future in load):
            found = scrape(workers.url)  # a new connection each time: either worker answers
            seen.append(tuple(found.get(key, 0.0) for key in SERVICE_SUMS))
    assert all(f.result().status_code == 200 for f in load)
    fallen = [(a, b) for a, b in zip(seen, seen[1:]) if any(y < x for x, y in zip(a, b))]
    assert any(y > x for x, y in zip(seen[0], seen[-1])) and not fallen, fallen


def test_the_concurrency_limit_holds_for_the_whole_gateway(workers):
    long = {"ignore_eos": True, "max_tokens": 300}
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: chat(workers.url, "Tell me a story.", **long), range(6)))
    statuses = sorted(r.status_code for r in responses)
    admitted = statuses.count(200)
    assert 1 <= admitted <= 2 and statuses.count(429) == 6 - admitted, statuses  # 2 in all: one per worker
    refusal = next(r for r in responses if r.status_code == 429).json()["error"]["message"]
    assert "limit of 1 concurrent requests (this worker's share: the gateway runs 2 workers)" in refusal


def test_a_killed_worker_is_replaced_and_its_requests_still_count(workers):
    before = scrape(workers.url)[OK]
    victim = min(workers.pids())
    os.kill(victim, signal.SIGKILL)
    # Reaped, not merely a zombie: a killed process's main thread shows as a
    # zombie while its other threads still exit, and they hold its listening
    # socket until the last one has (a connection queued there meanwhile is reset).
    wait_until(lambda: not psutil.pid_exists(victim), 10, "the worker dead and reaped (its listening socket closed)")
    for i in range(4):  # the other worker keeps the port: no request is refused meanwhile
        assert chat(workers.url, with_image(f"after-kill-{i}")).status_code == 200
    wait_until(lambda: victim not in workers.pids() and workers.all_ready(), 60, "a new worker in its place")
    assert scrape(workers.url)[OK] - before == 4  # the dead worker's counts are kept, not lost or doubled
    assert chat(workers.url, with_image("after-restart")).status_code == 200


def test_a_hung_worker_is_replaced(workers):
    """A stopped worker (SIGSTOP: a hung loop) keeps its listening socket, and the kernel its share of
    new connections; its supervisor hears no load from it and kills it for another."""
    victim = min(workers.pids())
    os.kill(victim, signal.SIGSTOP)
    wait_until(lambda: not psutil.pid_exists(victim), 30, "the hung worker killed and reaped")
    assert any(f"(pid {victim}) has not answered" in r["message"] for r in workers.records())
    wait_until(lambda: victim not in workers.pids() and workers.all_ready(), 60, "a new worker in its place")
    assert chat(workers.url, with_image("after-hang")).status_code == 200


def test_sighup_reaches_every_worker(workers):
    os.kill(workers.supervisor.pid, signal.SIGHUP)
    wait_until(lambda: workers.pids() <= workers.logged("routing map reloaded"), 30, "both workers reloaded their routing map")


def test_sigterm_lets_a_request_in_flight_finish_then_every_worker_exits(workers):
    running = workers.pids()
    with ThreadPoolExecutor(1) as pool:
        story = pool.submit(chat, workers.url, "Tell me a story.", ignore_eos=True, max_tokens=300)
        wait_until(lambda: scrape(workers.url).get(IN_FLIGHT, 0) >= 1, 30, "the story under way on one worker", 0.05)
        workers.supervisor.terminate()
        response = story.result()
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 300, response.text
    assert workers.supervisor.wait(60) == 0
    assert not any(psutil.pid_exists(pid) for pid in running), "the supervisor left workers behind"
