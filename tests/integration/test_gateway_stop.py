"""A gateway told to stop drains its streams for gateway.drain_timeout_s; uvicorn then cancels what
still runs, which cut a stream with neither an error event nor [DONE] and counted it as a client
that went away. A little before the deadline the streams still open end with a 503 error event
and [DONE]. On a gateway of its own, sharing the session stack's encoder and engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx

from common.config import REPO_ROOT
from testing.stack import free_port, serving
from tests.integration.conftest import MODEL_NAME


def test_a_stream_still_open_at_the_drain_deadline_ends_with_an_error_event_and_done(stack, tmp_path):
    port = free_port()
    env = dict(os.environ, PRISM_GATEWAY__PORT=str(port), PRISM_GATEWAY__DRAIN_TIMEOUT_S="4",
               PRISM_GATEWAY__ENCODER_ADDRESSES=json.dumps(stack.encoder_addresses),
               PRISM_GATEWAY__ENGINE_ADDRESSES=json.dumps(stack.engine_addresses))
    log = tmp_path / "gateway.log"
    process = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env=env, stdout=open(log, "wb"),
                               stderr=subprocess.STDOUT)
    body = {"model": MODEL_NAME, "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 1.0, "seed": 5,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    with serving(process, f"http://127.0.0.1:{port}", 120) as base_url:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            process.send_signal(signal.SIGTERM)  # 3,000 tokens take longer than the 4 s drain on this model
            events = [line for line in lines if line.startswith("data: ")]
        process.wait(30)  # uvicorn re-raises the SIGTERM it held once stopped: -15
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"], error
