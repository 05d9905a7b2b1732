"""vLLM's spawned processes (engine core, workers) sleep instead of spinning
when `engine.shm_wait_sleep_us` > 0: checked in a process spawned the way vLLM
spawns them, after the engine service's own set-up call."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from llm_engine.config import EngineConfig
from llm_engine.shm_wait import SLEEP_ENV
from llm_engine.spawned import SITE_DIR, customize_spawned_vllm_processes


def _yield_100_times() -> tuple[str, float]:
    """Which sched_yield the process has, and how long 100 calls take."""
    started = time.perf_counter()
    for _ in range(100):
        os.sched_yield()
    return os.sched_yield.__name__, time.perf_counter() - started


def _in_spawned_process(monkeypatch, sleep_us: int) -> tuple[str, float]:
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored after the test
    monkeypatch.delenv(SLEEP_ENV, raising=False)
    customize_spawned_vllm_processes(sleep_us)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_yield_100_times)


def test_spawned_processes_sleep_instead_of_spinning(monkeypatch):
    name, seconds = _in_spawned_process(monkeypatch, 2000)
    assert name == "_nap" and seconds >= 100 * 0.002  # a lower bound: a busy machine only adds to it


def test_zero_keeps_vllms_spin(monkeypatch):
    # os's own sched_yield, not timed: on a busy machine each yield may give up the core for a while
    assert _in_spawned_process(monkeypatch, 0)[0] == "sched_yield"
    assert SLEEP_ENV not in os.environ


def test_the_setting_is_bounded():
    with pytest.raises(ValueError, match="shm_wait_sleep_us"):
        EngineConfig(model="m", shm_wait_sleep_us=-1)


def test_a_sitecustomize_it_hides_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['HIDDEN_SITECUSTOMIZE_RAN'] = '1'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(tmp_path)]), SLEEP_ENV: "5"}
    code = "import os; print(os.sched_yield.__name__, os.environ.get('HIDDEN_SITECUSTOMIZE_RAN'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["_nap", "1"]
