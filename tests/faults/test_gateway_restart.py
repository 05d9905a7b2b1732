"""The gateway restarted while the encoder and the engine stay up, as on hosts
of their own (each service started alone, no supervisor between them): the
new gateway handshakes with the running services and serves; they are not
restarted, and a generation the dead gateway left behind is aborted in vLLM
(its replies have no one to go to).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from common.config import DEFAULT_CONFIG, REPO_ROOT
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import free_port, wait_for_health
from tests.integration.conftest import MODEL_NAME, ONE_PROCESS_ENGINE
from tests.integration.helpers import log_records, scrape, wait_until


class Services:
    """An encoder, an engine and a gateway, each its own process; the log is shared (JSON lines)."""

    def __init__(self, run_dir) -> None:
        self.run_dir = run_dir
        self.port = free_port()
        self.log = open(run_dir / "stack.log", "ab")
        self.env = {
            **os.environ,
            "PRISM_MODEL": str(RANDOM_MODEL),
            "PRISM_ENCODER__ADDRESS": f"ipc://{run_dir}/encoder.sock",
            "PRISM_ENGINE__ADDRESS": f"ipc://{run_dir}/engine.sock",
            "PRISM_GATEWAY__ENCODER_ADDRESSES": f'["ipc://{run_dir}/encoder.sock"]',
            "PRISM_GATEWAY__ENGINE_ADDRESSES": f'["ipc://{run_dir}/engine.sock"]',
            "PRISM_GATEWAY__PORT": str(self.port),
            "PRISM_GATEWAY__STATS_INTERVAL_S": "0.5",
            "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256",
            "PRISM_ENGINE__MAX_MODEL_LEN": "32768",
            **ONE_PROCESS_ENGINE,
        }
        self.processes: dict[str, subprocess.Popen] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, module: str) -> subprocess.Popen:
        self.processes[module] = subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(DEFAULT_CONFIG)], cwd=REPO_ROOT, env=self.env,
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        return self.processes[module]

    def start_gateway(self) -> None:
        wait_for_health(self.base_url, self.start("gateway"), timeout_s=300)  # waits for the services' handshakes

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    ensure_demo_model(RANDOM_MODEL)
    stack = Services(tmp_path_factory.mktemp("gateway-restart"))
    try:
        stack.start("vision_encoder")
        stack.start("llm_engine")
        stack.start_gateway()
        yield stack
    finally:
        stack.stop()


def chat(stack: Services, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}], **extra}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)


def test_a_restarted_gateway_rejoins_the_running_services(services):
    encoder, engine = services.processes["vision_encoder"], services.processes["llm_engine"]
    assert chat(services).status_code == 200
    long_story = {"max_tokens": 30000, "ignore_eos": True, "temperature": 1.0, "seed": 1, "stream": True,
                  "messages": [{"role": "user", "content": "Write a very long story."}]}
    with httpx.stream("POST", f"{services.base_url}/v1/chat/completions", json={"model": MODEL_NAME, **long_story},
                      headers={"X-Request-Id": "orphaned"}, timeout=60) as response:
        # Held in a variable: a line iterator dropped at once is garbage-collected,
        # which closes httpx's stream and so the connection, and the old gateway
        # could then see the client leave (and abort) before the kill lands.
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        os.killpg(services.processes["gateway"].pid, signal.SIGKILL)  # the gateway dies mid-stream
        services.processes["gateway"].wait(10)
    killed_at = time.monotonic()
    services.start_gateway()
    print(f"\na new gateway served again {time.monotonic() - killed_at:.1f} s after the old one was killed")
    assert chat(services).status_code == 200
    assert encoder.poll() is None and engine.poll() is None  # neither was restarted
    assert psutil.Process(engine.pid).create_time() < psutil.Process(services.processes["gateway"].pid).create_time()
    orphaned = [r["message"] for r in log_records(services, "engine", "orphaned")]
    assert "aborted: the gateway that sent it is gone" in orphaned
    assert not any(m.startswith("generated") for m in orphaned)
    wait_until(lambda: scrape(services)[("prism_service_in_flight_requests", (("service", "engine"),))] == 0, 5,
               "nothing left generating in vLLM")


def test_sigterm_while_the_gateway_awaits_its_services_stops_it_at_once(tmp_path):
    """uvicorn holds SIGTERM through the app's start-up, which waits for every service's handshake
    (gateway.startup_timeout_s): a gateway stopped then (a pod deleted, Ctrl-C) used to wait it out."""
    import zmq

    ctx = zmq.Context()
    engine = ctx.socket(zmq.ROUTER)  # an engine that never answers: still loading, as far as the gateway knows
    engine.bind(f"ipc://{tmp_path}/engine.sock")
    env = {**os.environ, "PRISM_GATEWAY__ENCODER_ADDRESSES": "[]", "PRISM_GATEWAY__PORT": str(free_port()),
           "PRISM_GATEWAY__ENGINE_ADDRESSES": f'["ipc://{tmp_path}/engine.sock"]', "PRISM_GATEWAY__STARTUP_TIMEOUT_S": "300"}
    with open(tmp_path / "gateway.log", "wb") as log:
        gateway = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert engine.poll(120_000), "the gateway's handshake never came"
        engine.recv_multipart()  # it is in start-up now, waiting for the answer
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=30)  # uvicorn raises the signal again once it has stopped: the exit is -SIGTERM
        assert "stopped while waiting for the services' handshakes" in (tmp_path / "gateway.log").read_text()
    finally:
        if gateway.poll() is None:
            gateway.kill()
        engine.close(linger=0)
        ctx.term()
