"""`prism serve` killed outright (SIGKILL, the OOM killer) while vLLM is still
starting: the gateway and the services it started must not outlive it. Each runs in a session
of its own, so only the kernel can tell them (common/supervisor.py
`stop_with_supervisor`), and the engine, told mid-start, must stop vLLM's
engine core before it exits, not leave it behind (llm_engine/__main__.py).
"""

from __future__ import annotations

import os
import signal

import psutil

from bench.faults import engine_core
from testing.stack import LocalStack
from tests.integration.conftest import ONE_PROCESS_ENGINE
from tests.integration.helpers import alive, child_pid, log_records, wait_until

ENGINE_START_S = 240  # vLLM's start on two busy cores, with room


def service(stack: LocalStack, module: str) -> psutil.Process | None:
    try:
        return psutil.Process(child_pid(stack, module))
    except (LookupError, psutil.NoSuchProcess):
        return None


def engine_messages(stack: LocalStack) -> list[str]:
    return [record["message"] for record in log_records(stack, "engine")]


def test_services_stop_when_the_launcher_is_killed_while_vllm_starts(tmp_path):
    stack = LocalStack(tmp_path, {"PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256", **ONE_PROCESS_ENGINE})
    launcher = stack.launch()
    groups = [launcher.pid]  # each service leads a process group of its own: all are killed at the end
    try:
        wait_until(lambda: service(stack, "vision_encoder") and service(stack, "llm_engine"), 60,
                   "the launcher started the encoder and the engine")
        wait_until(lambda: service(stack, "-m gateway"), 60, "the launcher started the gateway")
        encoder, engine, gateway = service(stack, "vision_encoder"), service(stack, "llm_engine"), service(stack, "-m gateway")
        groups += [encoder.pid, engine.pid, gateway.pid]
        wait_until(lambda: engine_core(engine) is not None, ENGINE_START_S, "vLLM's engine core started")
        core = engine_core(engine)
        assert not any(m.startswith("engine ready") for m in engine_messages(stack)), "vLLM is still starting"

        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)

        wait_until(lambda: not alive(gateway.pid), 30, "the gateway exits once the launcher is gone")
        encoder_s = wait_until(lambda: not alive(encoder.pid), 30, "the encoder exits once the launcher is gone")
        engine_s = wait_until(lambda: not alive(engine.pid), ENGINE_START_S, "the engine exits once the launcher is gone")
        print(f"\nafter the launcher's kill: the encoder exited in {encoder_s:.1f} s, the engine in {engine_s:.1f} s")
        wait_until(lambda: not alive(core.pid), 2, "vLLM's engine core is gone with its engine, not left behind")
        assert any(m.startswith("draining") for m in engine_messages(stack)), \
            "the engine finished starting, then stopped as if drained"
    finally:
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
