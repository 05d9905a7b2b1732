"""vLLM's engine core itself failing, on a stack of its own: stopped (what a
hung accelerator or a stuck collective looks like), stopped for good, and
killed during a stream. Prism's engine service must notice each, fail what
it holds with a clear 503, stop taking work, and come back (by itself, or
restarted by `prism serve`'s supervisor) within a measured bound. Last, a
drain whose vLLM shutdown hangs must not hold the engine's socket.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import psutil
import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from testing.stack import LocalStack
from tests.integration.conftest import MODEL_NAME, ONE_PROCESS_ENGINE
from tests.integration.helpers import engine_core, engine_pid, log_records, scrape, sse_error, wait_until

STALL_TIMEOUT_S = 3
STALL_RESTART_S = 12
CLIENT_TIMEOUT_S = 120
OVERRIDES = {
    "PRISM_GATEWAY__STATS_INTERVAL_S": "0.5",
    "PRISM_GATEWAY__HEARTBEAT_TIMEOUT_S": "2",
    "PRISM_ENGINE__STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
    "PRISM_ENGINE__STALL_RESTART_S": str(STALL_RESTART_S),
    "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256",
    "PRISM_ENGINE__MAX_MODEL_LEN": "32768",  # generations long enough to outlast any fault
    # The model in the engine core process: these faults are then the model's too
    # (test_faults' stack runs vLLM's CPU default, a worker process of its own).
    **ONE_PROCESS_ENGINE,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalStack(tmp_path_factory.mktemp("engine-faults"), OVERRIDES) as started:
        yield started


@dataclass
class Outcome:
    status: int
    code: str | None  # the error's code (a stream's final error event included); None when it succeeded
    ended_at: float  # monotonic
    headers: httpx.Headers


def body(stream: bool, max_tokens: int = 30000) -> dict:
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": 5,
            "stream": stream, "messages": [{"role": "user", "content": "Write a very long story."}]}


def send(stack: LocalStack, payload: dict) -> Outcome:
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=payload, timeout=CLIENT_TIMEOUT_S) as response:
        response.read()
        ended_at = time.monotonic()
    if response.status_code != 200:
        return Outcome(response.status_code, response.json()["error"]["code"], ended_at, response.headers)
    if not payload["stream"]:
        return Outcome(200, None, ended_at, response.headers)
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]", "a stream must end cleanly, with or without an error event"
    error = sse_error(lines)
    return Outcome(200, error and error["code"], ended_at, response.headers)


def engine_in_flight(stack: LocalStack) -> float:
    return scrape(stack)[("prism_service_in_flight_requests", (("service", "engine"),))]


def ready(stack: LocalStack) -> int:
    return httpx.get(f"{stack.base_url}/health/ready", timeout=5).status_code


def serves(stack: LocalStack) -> bool:
    return send(stack, body(stream=False, max_tokens=4)).status == 200


def engine_start_up_s(stack: LocalStack, pid: int) -> float:
    """How long the engine process `pid` took from its start to 'engine ready' (its log)."""
    created = psutil.Process(pid).create_time()
    for record in log_records(stack, "engine"):
        if record["message"].startswith("engine ready"):
            at = datetime.datetime.strptime(record["time"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= created:
                return at - created
    raise LookupError(f"engine {pid} never said it was ready")


def test_the_model_runs_in_the_engine_core_process_with_vllm_s_openmp_settings(stack):
    """vLLM's CPU platform turns "uni" into "mp" unless told otherwise, and gives only its
    worker process OpenMP threads and binding (both handled in llm_engine/service.py `start_vllm`)."""
    assert serves(stack)  # the model has run: OpenMP has bound its thread
    core = engine_core(stack)
    workers = [p.name() for p in core.children(recursive=True) if "Worker" in p.name()]
    assert workers == []
    # vLLM keeps a core for everything else (its reserved CPUs); torch's default would use them all
    assert len(core.cpu_affinity()) < psutil.cpu_count()


def test_a_stopped_engine_core_fails_its_requests_and_serves_again_when_continued(stack):
    core = engine_core(stack)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(send, stack, body(stream=i % 2 == 0)) for i in range(4)]
        wait_until(lambda: engine_in_flight(stack) == 4, 30, "four requests generating")
        stopped_at = time.monotonic()
        core.suspend()
        try:
            outcomes = [future.result() for future in futures]
            refused = send(stack, body(stream=False, max_tokens=4))  # while it is stalled
            wait_until(lambda: ready(stack) == 503, 30, "the gateway routes nothing to a stalled engine")
            time.sleep(max(0.0, stopped_at + 2 * STALL_TIMEOUT_S - time.monotonic()))  # the behaviour: still refused after a stall of twice the timeout, probing
            assert ready(stack) == 503
        finally:
            continued_at = time.monotonic()
            core.resume()
    ended = [round(o.ended_at - stopped_at, 1) for o in outcomes]
    print(f"\nrequests ended {ended} s after the engine core stopped")
    assert [(o.status if o.code is None else o.code) for o in outcomes].count("engine_stalled") == 4, outcomes
    non_streaming = [o for o in outcomes[1::2]]
    assert all(o.status == 503 and o.headers["retry-after"] for o in non_streaming)
    assert refused.status == 503 and refused.code in ("engine_stalled", "service_unavailable")
    resumed = wait_until(lambda: serves(stack), 10, "serving again after the engine core continued")
    print(f"serving again {resumed:.1f} s after the engine core continued ({continued_at - stopped_at:.1f} s stopped)")
    stalled = log_records(stack, "engine")
    assert any("engine.stall_timeout_s" in r["message"] for r in stalled)
    assert scrape(stack)[("prism_stalls_total", (("service", "engine"),))] >= 1


def test_a_stall_that_does_not_clear_restarts_the_engine(stack):
    stalled_pid, core = engine_pid(stack), engine_core(stack)
    core.suspend()
    try:
        stalled = send(stack, body(stream=False, max_tokens=4))
        assert stalled.status == 503 and stalled.code == "engine_stalled"
        wait_until(lambda: engine_pid(stack) not in (stalled_pid, None), STALL_RESTART_S + 15, "the engine exited and was restarted")
    finally:
        if core.is_running():
            core.resume()
    assert any(r["message"].endswith("exiting for a restart") and "engine.stall_restart_s" in r["message"]
               for r in log_records(stack, "engine"))
    wait_until(lambda: ready(stack) == 200, 180, "the restarted engine rejoined")
    assert serves(stack)


def test_engine_core_killed_during_a_stream(stack):
    with ThreadPoolExecutor(3) as pool:
        stream = pool.submit(send, stack, body(stream=True))
        others = [pool.submit(send, stack, body(stream=False)) for _ in range(2)]
        wait_until(lambda: engine_in_flight(stack) == 3, 30, "three requests generating")
        killed_pid = engine_pid(stack)
        killed_at = time.monotonic()
        engine_core(stack).kill()
        outcomes = [stream.result(), *(f.result() for f in others)]
    print(f"\nrequests ended {[round(o.ended_at - killed_at, 1) for o in outcomes]} s after the engine core was killed")
    assert all(o.status in (200, 503) and o.code == "engine_dead" for o in outcomes), outcomes  # not a timeout's 504
    wait_until(lambda: ready(stack) == 503, 30, "the gateway sends nothing new to a dead engine")
    assert any(r["message"].startswith("vLLM's engine core died") for r in log_records(stack, "engine"))
    wait_until(lambda: engine_pid(stack) not in (killed_pid, None), 15, "the engine service exited and was restarted")
    new_pid = engine_pid(stack)
    wait_until(lambda: ready(stack) == 200, 180, "the restarted engine rejoined")
    recovery = time.monotonic() - killed_at
    start_up = engine_start_up_s(stack, new_pid)
    print(f"\nEngineCore killed: serving again after {recovery:.1f} s (the new engine's start-up: {start_up:.1f} s)")
    assert serves(stack)


def test_a_drained_engine_lets_go_of_its_socket_before_vllm_shuts_down(stack):
    """vLLM's shutdown and the interpreter's exit take seconds after a drain; a request
    sent to the engine meanwhile would wait unanswered until the gateway's heartbeat
    gave up. So once its requests are done the engine closes its socket first, and
    every gateway sees the connection drop at once. Here the engine core is stopped:
    vLLM's shutdown can only end by killing it, after its own grace period, so the
    drop must come while the core is still there. The last test: the engine restarts."""
    drained_pid, core = engine_pid(stack), engine_core(stack)
    ctx = zmq.Context()
    watcher = ctx.socket(zmq.DEALER)
    events = watcher.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        watcher.connect(stack.engine_addresses[0])
        assert next_socket_event(events) == zmq.EVENT_CONNECTED
        core.suspend()
        os.kill(drained_pid, signal.SIGTERM)  # nothing in flight: drained at once
        assert next_socket_event(events) == zmq.EVENT_DISCONNECTED
        still_stopped = core.is_running() and core.status() == psutil.STATUS_STOPPED
        assert still_stopped, "the socket stayed open until vLLM's shutdown had killed the engine core"
    finally:
        if core.is_running():
            core.resume()
        watcher.disable_monitor()
        events.close(linger=0)
        watcher.close(linger=0)
        ctx.term()
    assert any(r["message"].startswith("draining: 0 requests") for r in log_records(stack, "engine"))
    wait_until(lambda: engine_pid(stack) not in (drained_pid, None), 60, "the launcher restarted the engine")


def next_socket_event(events: zmq.Socket, timeout_s: float = 30) -> int:
    assert events.poll(timeout_s * 1000), f"no connection event within {timeout_s} s"
    return parse_monitor_message(events.recv_multipart())["event"]
