"""Nothing a supervisor (common/supervisor.py) started outlives it: neither
what a child left in its process group when it stopped, nor the children
themselves when the supervisor is killed; nor what a process stopped with
`stop_group` (prism serve under the tests and benchmarks, vLLM's server) left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.config import REPO_ROOT
from common.supervisor import Child, Supervisor, stop_group
from tests.integration.helpers import alive, wait_until

CHILD = "tests.unit.supervised_child"
# A supervisor in a process of its own, so that the test can kill it.
SUPERVISOR = ("import sys, time; from common.supervisor import Child, Supervisor; "
              f"Supervisor([Child({CHILD!r}, None)]).start(); time.sleep(600)")


def started_pids(pids_file: Path) -> tuple[int, int]:
    """(the child, the process it left in its group), once the child has written them."""
    wait_until(lambda: pids_file.exists() and pids_file.read_text(), 30, "the child started")
    child, leftover = map(int, pids_file.read_text().split())
    return child, leftover


@pytest.fixture
def pids_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PIDS_FILE", str(tmp_path / "pids"))
    return tmp_path / "pids"


@pytest.fixture
def cleanup():
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_stopping_a_child_stops_what_it_left_in_its_group(pids_file, cleanup):
    supervisor = Supervisor([Child(CHILD, None)])
    supervisor.start()
    child, leftover = started_pids(pids_file)
    cleanup.append(child)
    supervisor.stop(grace_s=10)
    assert supervisor.children[0].process.returncode == -signal.SIGTERM  # it ended on SIGTERM: not killed past the grace
    assert not alive(child)
    wait_until(lambda: not alive(leftover), 5, "the process that ignores SIGTERM is killed with its group")


def test_children_get_sigterm_when_their_supervisor_is_killed(pids_file, cleanup):
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR], cwd=REPO_ROOT, start_new_session=True)
    cleanup.append(supervisor.pid)
    child, _leftover = started_pids(pids_file)
    cleanup.append(child)
    assert alive(child)
    os.kill(supervisor.pid, signal.SIGKILL)  # no stop(): the kernel has to tell the child
    supervisor.wait(10)
    wait_until(lambda: not alive(child), 5, "the child exits once its supervisor is gone")


def test_stopping_a_group_stops_what_its_leader_left(pids_file, cleanup):
    leader = subprocess.Popen([sys.executable, "-m", CHILD], cwd=REPO_ROOT, start_new_session=True)
    cleanup.append(leader.pid)
    _, leftover = started_pids(pids_file)
    stop_group(leader, grace_s=10)
    assert leader.returncode == -signal.SIGTERM  # it ended on SIGTERM: not killed past the grace
    wait_until(lambda: not alive(leftover), 5, "the process that ignores SIGTERM is killed with its group")


def test_a_process_no_supervisor_started_is_left_alone(pids_file, cleanup):
    child = subprocess.Popen([sys.executable, "-m", CHILD], cwd=REPO_ROOT, start_new_session=True)
    cleanup.append(child.pid)
    started_pids(pids_file)
    time.sleep(0.5)  # a window for a wrong SIGTERM to land: what is tested is that nothing happens, no state to wait for
    assert child.poll() is None


RESTARTED = "tests.unit.restarted_child"


@pytest.fixture
def supervisors():
    started: list[Supervisor] = []
    yield started
    for supervisor in started:
        supervisor.stop(grace_s=5)


def test_an_error_while_restarting_one_child_stops_no_restart(supervisors):
    """The watcher thread restarts every child (and the kernel's death signal follows it):
    an exception there used to end it, and with it every child it had restarted."""
    def on_exit(child: Child) -> None:
        raise RuntimeError("the bookkeeping for a dead child failed")

    failing = Child(RESTARTED, None, name="fails at start-up", backoff_s=0.1)
    supervisor = Supervisor([failing], max_backoff_s=0.2, on_exit=on_exit)
    supervisors.append(supervisor)
    supervisor.start()
    wait_until(lambda: failing.restarts >= 3, 20, "restarted again and again, each exit's on_exit failing")


def test_a_child_that_refused_its_config_is_not_restarted_and_the_supervisor_is_told(supervisors):
    """The same config would be refused again: `prism serve` stops, naming the child, instead of
    restarting it until the gateway's start-up timeout."""
    from common.config import EXIT_CONFIG

    refused: list[Child] = []
    child = Child(RESTARTED, None, env={"CHILD_EXITS": str(EXIT_CONFIG)}, name="refuses its config", backoff_s=0.01)
    supervisor = Supervisor([child], max_backoff_s=0.01, on_refused=refused.append)
    supervisors.append(supervisor)
    supervisor.start()
    wait_until(lambda: refused, 20, "the supervisor told of the refusal")
    time.sleep(0.5)  # many back-offs' time: what is tested is that no restart comes
    assert refused == [child] and child.restarts == 0


def test_a_child_waiting_out_a_long_back_off_delays_no_other_restart(supervisors):
    failing = Child(RESTARTED, None, name="fails at start-up", backoff_s=60)
    running = Child(RESTARTED, None, env={"CHILD_SLEEPS": "1"}, name="runs")
    supervisor = Supervisor([failing, running], max_backoff_s=60)
    supervisors.append(supervisor)
    supervisor.start()
    wait_until(lambda: failing.process.poll() is not None, 20, "the failing child exited")  # its 60 s back-off begins
    first = running.process.pid
    os.killpg(first, signal.SIGKILL)
    wait_until(lambda: running.restarts == 1 and running.process.pid != first, 20, "the killed child restarted")
    assert failing.restarts == 0  # still waiting out its own back-off


def test_a_child_that_answered_and_then_fell_silent_is_killed_and_restarted(supervisors):
    """A hung loop in a live process: it would hold its socket for ever (`prism serve` probes
    its services with a Hello; here the probe is the test's)."""
    silent: set[int] = set()
    child = Child(RESTARTED, None, env={"CHILD_SLEEPS": "1"}, name="falls silent")
    child.probe = lambda: child.process.pid not in silent
    supervisor = Supervisor([child], liveness_s=0.5, probe_interval_s=0.05)
    supervisors.append(supervisor)
    supervisor.start()
    wait_until(lambda: child.answered is not None, 10, "the child answered its probe")
    deaf_process = child.process
    deaf = deaf_process.pid
    silent.add(deaf)
    wait_until(lambda: child.restarts == 1 and child.process.pid != deaf, 20, "the silent child killed and restarted")
    assert not alive(deaf)
    assert deaf_process.returncode == -signal.SIGTERM  # told first (vLLM then removes its shared memory), not SIGKILLed
    wait_until(lambda: child.answered[0] == child.process.pid, 10, "the new child answering")


def test_a_child_that_never_answered_is_left_to_start(supervisors):
    """vLLM takes minutes to start on a GPU host: a child is judged only once it has answered."""
    child = Child(RESTARTED, None, env={"CHILD_SLEEPS": "1"}, name="still starting", probe=lambda: False)
    supervisor = Supervisor([child], liveness_s=0.1, probe_interval_s=0.02)
    supervisors.append(supervisor)
    supervisor.start()
    time.sleep(1)  # a window for a wrong kill to land: what is tested is that nothing happens
    assert child.restarts == 0 and child.process.poll() is None


def test_a_probed_child_is_stable_only_once_it_has_served_a_while():
    """The back-off resets for a stable child: a probed one counts from its first answer, so an
    engine that loads for minutes and then fails keeps backing off instead of restarting each second."""
    from types import SimpleNamespace

    supervisor = Supervisor([], stable_after_s=60, liveness_s=10)
    loading = Child(RESTARTED, None, probe=lambda: False, process=SimpleNamespace(pid=7), started_at=time.monotonic() - 600)
    assert not supervisor.was_stable(loading)  # ten minutes up, never answered
    loading.first_answered = (7, time.monotonic() - 5)
    assert not supervisor.was_stable(loading)  # serving for 5 s
    loading.first_answered = (7, time.monotonic() - 61)
    assert supervisor.was_stable(loading)
    loading.process = SimpleNamespace(pid=8)  # restarted: its predecessor's answers are not its own
    assert not supervisor.was_stable(loading)
    unprobed = Child(RESTARTED, None, process=SimpleNamespace(pid=9), started_at=time.monotonic() - 61)
    assert supervisor.was_stable(unprobed)
