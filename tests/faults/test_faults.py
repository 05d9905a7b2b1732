"""Bad days, on a stack of their own: services killed under load, bursts past
capacity, clients that hang up, and a graceful shutdown (last: it ends the stack).

Every request must end in a response — 200, 429, 503 or a clean stream error
event — never a hang, and the stack must come back by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from testing.stack import LocalStack
from loadtest.synthetic import make_image
from tests.integration.conftest import MODEL_NAME
from tests.integration.corpus import b64, save
from tests.integration.helpers import child_pid, log_records, metric_total, scrape, service_pid, wait_until

CLIENT_TIMEOUT_S = 90  # a request still unanswered after this counts as hung
CHILD_LIVENESS_S = 8
OVERRIDES = {
    "PRISM_GATEWAY__STATS_INTERVAL_S": "0.5",
    "PRISM_GATEWAY__HEARTBEAT_TIMEOUT_S": "2",
    "PRISM_GATEWAY__MAX_CONCURRENT_REQUESTS": "6",
    "PRISM_GATEWAY__DRAIN_TIMEOUT_S": "30",
    "PRISM_ENCODER__MAX_BATCH_IMAGES": "1",  # queued work stays queued long enough to be cancelled
    "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256",
    "PRISM_ENGINE__MAX_MODEL_LEN": "32768",  # generations long enough to outlast any stall
    "PRISM_GATEWAY__BODY_TIMEOUT_S": "2",
    "PRISM_GATEWAY__STREAM_WRITE_TIMEOUT_S": "2",
    "PRISM_GATEWAY__CHILD_LIVENESS_S": str(CHILD_LIVENESS_S),
}
BODY_TIMEOUT_S = STREAM_WRITE_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    stack = LocalStack(tmp_path_factory.mktemp("faults"), OVERRIDES)
    stack.start()
    yield stack
    stack.stop()


def image_url(name: str, size=(640, 480)) -> str:
    return b64(save(make_image(name, size), "PNG"))


def payload(i: int, stream: bool, max_tokens: int = 8) -> dict:
    content: list | str = "Tell me something."
    if i % 3:  # two in three with an image; every other image repeats
        content = [{"type": "image_url", "image_url": {"url": image_url(f"load-{i if i % 2 else 0}")}}, {"type": "text", "text": "What is it?"}]
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "stream": stream, "messages": [{"role": "user", "content": content}]}


def outcome(stack: LocalStack, i: int, body: dict | None = None) -> str:
    """One request's fate: ok, 429, 503, stream-error, other:<status> or hung."""
    stream = i % 2 == 0
    body = body or payload(i, stream)
    try:
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S) as response:
            if response.status_code != 200:
                response.read()
                assert "error" in response.json()
                return str(response.status_code) if response.status_code in (429, 503) else f"other:{response.status_code}"
            if not stream:
                response.read()
                return "ok" if response.json()["choices"] else "other:empty"
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
            if events[-1] != "data: [DONE]":
                return "other:unterminated-stream"
            return "stream-error" if any('"error"' in e for e in events) else "ok"
    except httpx.TimeoutException:
        return "hung"


class Load:
    """Bounded, closed-loop load on loopback until stopped."""

    def __init__(self, stack: LocalStack, workers: int = 3, max_requests: int = 400) -> None:
        self.stack, self.results, self.sent = stack, Counter(), 0
        self._stop = threading.Event()
        self._max = max_requests
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers)
        self._futures = [self._pool.submit(self._worker) for _ in range(workers)]

    def _next(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self.sent >= self._max:
                return None
            self.sent += 1
            return self.sent

    def _worker(self) -> None:
        while (i := self._next()) is not None:
            result = outcome(self.stack, i)
            with self._lock:
                self.results[result] += 1
            if result in ("429", "503"):
                time.sleep(0.2)  # as a client honouring Retry-After would, if less patiently

    def stop(self) -> Counter:
        self._stop.set()
        for future in self._futures:
            future.result()
        self._pool.shutdown()
        return self.results


def wait_ready(stack: LocalStack, want: int, timeout_s: float) -> float:
    """Seconds until /health/ready answers `want` (200 ready, 503 degraded)."""
    ready = f"{stack.base_url}/health/ready"
    return wait_until(lambda: httpx.get(ready, timeout=5).status_code == want, timeout_s, f"/health/ready answering {want}")


def test_kill_encoder_then_engine_under_load(faulty):
    load = Load(faulty)
    recovery = {}
    try:
        wait_until(lambda: load.results["ok"] >= 3, 60, "the load under way", observe=lambda: load.results)
        for module in ("vision_encoder", "llm_engine"):
            os.kill(child_pid(faulty, module), signal.SIGKILL)
            noticed = wait_ready(faulty, 503, 10)  # heartbeats: within seconds
            recovery[module] = noticed + wait_ready(faulty, 200, 180)
            time.sleep(3)  # paced: the load runs on the recovered stack a while before the next kill
    finally:
        results = load.stop()
    print(f"\nrecovery after kill -9: {recovery}; outcomes: {dict(results)}")
    assert results["hung"] == 0
    assert sum(results.values()) == load.sent
    assert set(results) <= {"ok", "429", "503", "stream-error"}, results
    assert results["ok"] > 0 and results["503"] + results["stream-error"] > 0  # the outages were felt, and survived
    assert outcome(faulty, 1) == "ok" and outcome(faulty, 2) == "ok"  # serving normally again
    assert httpx.get(f"{faulty.base_url}/health/live", timeout=5).status_code == 200


def test_burst_past_capacity_gets_429s_and_no_server_errors(faulty):
    bodies = {i: payload(i, i % 2 == 0, max_tokens=64) for i in range(100, 124)}  # built before the clock starts
    gate = threading.Barrier(24)

    def fire(i: int) -> tuple[str, float]:
        gate.wait()
        started = time.monotonic()
        return outcome(faulty, i, bodies[i]), time.monotonic() - started

    with ThreadPoolExecutor(24) as pool:
        fired = list(pool.map(fire, bodies))
    results = Counter(result for result, _ in fired)
    admitted = sorted(seconds for result, seconds in fired if result == "ok")
    print(f"\nburst of 24 at a limit of 6: {dict(results)}; admitted requests took {admitted[0]:.2f}–{admitted[-1]:.2f} s")
    assert results["429"] > 0 and results["ok"] > 0
    assert set(results) <= {"ok", "429"}, results  # every admitted request got a 200, the rest a 429
    # Admitted latency is printed above, not asserted: speed under bursts belongs in bench/ (bench/burst.py)


def encoder_queue(stack: LocalStack) -> float:
    return scrape(stack).get(("prism_queue_depth", (("service", "encoder"),)), 0.0)


def test_encoder_killed_mid_batch(faulty):
    """What an OOM kill looks like: SIGKILL while batches of large images run."""
    bodies = [{"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url(f"oom-{r}-{i}", (1920, 1080))}} for i in range(8)]}]} for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(httpx.post, f"{faulty.base_url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S) for body in bodies]
        wait_until(lambda: encoder_queue(faulty) > 0, 60, "images queued behind a running batch", every_s=0.05)
        killed_at = time.monotonic()
        os.kill(child_pid(faulty, "vision_encoder"), signal.SIGKILL)
        responses = [future.result() for future in futures]
        ended = time.monotonic() - killed_at
    print(f"\nencoder killed mid-batch: its requests ended {ended:.2f} s later with {[r.status_code for r in responses]}")
    for response in responses:
        assert response.status_code == 503 and response.headers["retry-after"]
        assert response.json()["error"]["type"] == "server_error" and "vision encoder" in response.json()["error"]["message"]
    recovered = wait_until(lambda: outcome(faulty, 1) == "ok", 120, "serving images again")
    print(f"serving images again {recovered:.1f} s after the kill was noticed")


def test_a_hung_encoder_process_is_restarted_by_its_launcher(faulty):
    """A live process that stopped answering (its loop hung; here SIGSTOP): the gateway marks it
    down at its heartbeat, and `prism serve` kills it once it has been silent
    gateway.child_liveness_s, so that it is restarted as if it had died. The encoder's counters
    in the gateway's sums do not fall with it."""
    hung = child_pid(faulty, "vision_encoder")
    wait_until(lambda: any(r["message"].startswith(f"vision_encoder[prism-demo:0] (pid {hung}) answers on its socket")
                           for r in log_records(faulty, "gateway")), 30, "the launcher watching the encoder (it answered once)")
    counted = scrape(faulty)
    os.kill(hung, signal.SIGSTOP)
    try:
        wait_until(lambda: service_pid(faulty, "vision_encoder") not in (hung, None), CHILD_LIVENESS_S + 30, "the hung encoder replaced")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
    assert any("has not answered on its socket" in r["message"] and "gateway.child_liveness_s" in r["message"]
               for r in log_records(faulty, "gateway"))
    wait_until(lambda: outcome(faulty, 1) == "ok", 120, "serving images again")
    assert not fallen_sums(counted, scrape(faulty))  # the new process counts from zero; the sums go on


def fallen_sums(before: dict, after: dict) -> dict:
    """Counter samples summed over replicas (no replica label: a replica's own series may reset)
    that are lower in `after` than in `before`: Prometheus would read each as a reset of the sum."""
    monotonic = ("_total", "_bucket", "_count", "_sum")
    return {key: (value, after.get(key)) for key, value in before.items()
            if key[0].endswith(monotonic) and "replica" not in dict(key[1]) and after.get(key, 0.0) < value}


def engine_log_lines(stack: LocalStack, request_prefix: str) -> list[dict]:
    return log_records(stack, "engine", request_prefix)


def gateway_statuses(stack: LocalStack, request_prefix: str) -> list[str]:
    """The gateway's closing log lines for a request, e.g. "status 499 (client_disconnected)"."""
    records = log_records(stack, "gateway", request_prefix)
    return [r["message"].split(":")[0] for r in records if r["message"].startswith("status ")]


def engine_in_flight(stack: LocalStack) -> float:
    return scrape(stack)[("prism_service_in_flight_requests", (("service", "engine"),))]


def hang_up(stack: LocalStack, body: dict, rid: str) -> None:
    """A client that leaves mid-generation: a stream after its first event, a
    plain request after 0.3 s without an answer."""
    url, headers = f"{stack.base_url}/v1/chat/completions", {"X-Request-Id": rid}
    if body["stream"]:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
            assert next(response.iter_lines()).startswith("data: {")
        return  # leaving the block closes the connection with the stream unread
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, headers=headers, timeout=0.3)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_aborts_generation(faulty, stream):
    rid = f"hangup-{'s' if stream else 'n'}"
    # 30,000 tokens take about a minute here: the hang-up reaches vLLM mid-generation.
    body = {"model": MODEL_NAME, "max_tokens": 30000, "ignore_eos": True, "temperature": 1.0, "seed": 3, "stream": stream,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    hang_up(faulty, body, rid)
    wait_until(lambda: gateway_statuses(faulty, rid), 90, "the gateway logging the request's end")
    wait_until(lambda: engine_in_flight(faulty) == 0, 30, "nothing left running in vLLM")
    assert gateway_statuses(faulty, rid) == ["status 499 (client_disconnected)"]  # once, and not after a 200
    assert not any(r["message"].startswith("generated") for r in engine_log_lines(faulty, rid)), "vLLM generated to the end"
    wait_until(lambda: any(r["message"] == "aborted" for r in engine_log_lines(faulty, rid)), 10, "the abort reaching vLLM")


def post_then_hang_up(stack: LocalStack, body: dict, when) -> None:
    """POST over a raw socket and close it, unanswered, once `when()` holds."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", stack.port)) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: prism\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_until(when, 30, "the request reaching the encoder")
        conn.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            pytest.fail(f"answered before the client hung up: {conn.recv(200, socket.MSG_PEEK)!r}")


def test_abandoned_unique_image_is_not_encoded(faulty):
    dropped_before = metric_total(faulty, "prism_encoder_jobs_dropped_total")
    sent_before = metric_total(faulty, "prism_encoder_replica_requests_total")

    def encoder_requests() -> float:  # one per request: new images go with their pixels at once (gateway/routing/handoff.py)
        return metric_total(faulty, "prism_encoder_replica_requests_total") - sent_before

    # One image per batch (this stack's setting): two requests of eight images
    # each put sixteen encodes in the queue at once (a request's missing images
    # are sent together), over a second of work ahead of the abandoned one.
    busy = ThreadPoolExecutor(2)
    bodies = [{"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url(f"busy-{r}-{i}", (1280, 720))}} for i in range(8)]}]} for r in range(2)]
    futures = [busy.submit(httpx.post, f"{faulty.base_url}/v1/chat/completions", timeout=60, json=body) for body in bodies]
    wait_until(lambda: encoder_requests() >= 2, 10, "both requests' images sent to the encoder")
    abandoned = {"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url("abandoned", (1280, 960))}}]}]}
    # queued behind them, then abandoned
    post_then_hang_up(faulty, abandoned, lambda: encoder_requests() >= 3)
    assert [f.result().status_code for f in futures] == [200, 200], [f.result().text[:300] for f in futures]
    busy.shutdown()
    wait_until(lambda: metric_total(faulty, "prism_encoder_jobs_dropped_total") > dropped_before, 10, "the abandoned encode dropped")


def gateway_in_flight(stack: LocalStack) -> float:
    return scrape(stack)[("prism_in_flight_requests", (("service", "gateway"),))]


def raw_post(conn: socket.socket, body: bytes, rid: str = "") -> None:
    """Headers only: the body is the caller's to send."""
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: prism\r\nContent-Type: application/json\r\n"
                 b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n" % (rid.encode(), len(body)))


def test_a_body_sent_at_one_byte_a_second_gets_408_and_holds_no_slot(faulty):
    body = json.dumps(payload(0, stream=False)).encode()
    with socket.create_connection(("127.0.0.1", faulty.port)) as conn:
        raw_post(conn, body, "slow-body")
        started = time.monotonic()
        conn.settimeout(1.0)
        answer = b""
        for byte in body[: BODY_TIMEOUT_S + 5]:  # one byte a second
            conn.sendall(bytes([byte]))
            with contextlib.suppress(TimeoutError):
                answer = conn.recv(4096)
            if answer:
                break
        waited = time.monotonic() - started
        conn.settimeout(5)
        # The rest of the answer, until the gateway closes the connection. A byte
        # sent after the gateway stopped reading is unread at its close, so the
        # close may come as a reset: the answer is whatever arrived before it.
        with contextlib.suppress(ConnectionResetError):
            while chunk := conn.recv(4096):
                answer += chunk
    print(f"\na body at 1 byte/s was answered after {waited:.1f} s: {answer.splitlines()[0]!r}")
    assert answer.startswith(b"HTTP/1.1 408") and b"gateway.body_timeout_s" in answer
    wait_until(lambda: gateway_in_flight(faulty) == 0, 5, "its slot given back")


def test_a_stream_nobody_reads_is_cut_and_its_generation_aborted(faulty):
    rid = "unread-stream"
    # Twenty alternatives per token make each chunk ~2 KB, so the buffers fill in a few thousand tokens: with
    # ~200-byte chunks it took ~20,000, longer than the wait below on a slow machine (failed once so, at 150 s).
    body = json.dumps({"model": MODEL_NAME, "max_tokens": 30000, "ignore_eos": True, "temperature": 1.0, "seed": 3,
                       "logprobs": True, "top_logprobs": 20, "stream": True,
                       "messages": [{"role": "user", "content": "Write a very long story."}]}).encode()
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills in a few hundred tokens
        conn.connect(("127.0.0.1", faulty.port))
        raw_post(conn, body, rid)
        conn.sendall(body)
        # Never read: the socket buffers fill (megabytes: Linux grows the gateway's send buffer), then the deadline runs.
        cut = wait_until(lambda: gateway_statuses(faulty, rid), 150, "the gateway gave up on the stream")
    print(f"\na stream nobody read was cut after {cut:.1f} s")
    assert gateway_statuses(faulty, rid) == ["status 408 (client_not_reading)"]
    wait_until(lambda: any(r["message"] == "aborted" for r in engine_log_lines(faulty, rid)), 10, "vLLM aborted it")
    assert not any(r["message"].startswith("generated") for r in engine_log_lines(faulty, rid)), "vLLM generated to the end"
    wait_until(lambda: gateway_in_flight(faulty) == 0 and engine_in_flight(faulty) == 0, 10, "nothing left in flight")


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_gateway_that_crashes_is_restarted_by_its_launcher(faulty):
    """A crash of the gateway's own process (here a SIGSEGV sent to it; a native image decoder's on a
    crafted upload would do the same, where videos' run in decoder processes of their own): `prism
    serve` starts it again as it restarts any service, and the services go on. In the launcher's own
    process, as it ran before, the crash took every service with it."""
    crashed = child_pid(faulty, "-m gateway")
    services = {module: child_pid(faulty, module) for module in ("vision_encoder", "llm_engine")}
    os.kill(crashed, signal.SIGSEGV)
    wait_until(lambda: service_pid(faulty, "-m gateway") not in (crashed, None), 60, "the gateway started again")
    wait_until(lambda: answers_ok(faulty), 180, "serving images again")
    assert {module: service_pid(faulty, module) for module in services} == services  # the same processes


def answers_ok(stack: LocalStack) -> bool:
    """A request with an image answered; False while nothing listens on the gateway's port."""
    try:
        return outcome(stack, 1) == "ok"
    except httpx.ConnectError:
        return False


def test_graceful_shutdown_drains_in_flight_streams(faulty):
    body = {"model": MODEL_NAME, "max_tokens": 400, "temperature": 1.0, "seed": 11, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "Write a long story."}]}
    with httpx.stream("POST", f"{faulty.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(lines)
        services = psutil.Process(faulty.process.pid).children(recursive=True)  # vLLM's engine core included
        log_before_stop = faulty.stack_log.stat().st_size
        os.killpg(faulty.process.pid, signal.SIGTERM)  # launcher and children: stop accepting, drain, exit
        rest = [line for line in lines if line.startswith("data: ")]
    # An impatient second one once the gateway has closed, as the launcher stops its services: it must not
    # cut that stop short (while uvicorn still drains, uvicorn takes it as the first).
    wait_until(lambda: not port_open(faulty.port), 60, "the gateway closed")
    with contextlib.suppress(ProcessLookupError):
        os.kill(faulty.process.pid, signal.SIGTERM)
    assert first.startswith("data: {")
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 400  # generated to its end, not aborted at the SIGTERM
    assert faulty.process.wait(60) == 0
    assert not [p.pid for p in services if alive(p)]  # none left behind
    with faulty.stack_log.open("rb") as log:
        log.seek(log_before_stop)
        stop_output = log.read().decode(errors="replace")
    assert "Exception ignored" not in stop_output and "Traceback" not in stop_output, stop_output[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{faulty.base_url}/health/live", timeout=2)
