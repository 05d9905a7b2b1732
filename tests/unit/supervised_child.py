"""A child for tests/unit/test_supervisor.py, standing in for an engine service:
it starts a process of its own group that ignores SIGTERM (as vLLM's engine
core does while it is being built), and waits; that process writes both pids
to $PIDS_FILE once it ignores SIGTERM.
It exits on SIGTERM (Python's default action: die)."""

from __future__ import annotations

import subprocess
import sys
import time

from common.supervisor import stop_with_supervisor

IGNORES_SIGTERM = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "open(os.environ['PIDS_FILE'], 'w').write(f'{os.getppid()} {os.getpid()}'); time.sleep(600)")

if __name__ == "__main__":
    stop_with_supervisor()
    subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM])
    time.sleep(600)
