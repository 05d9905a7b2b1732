"""The encoder stops on SIGTERM by its own handler (exit status 0), as a
container's first process must: without one, Linux ignores SIGTERM for a
PID 1 and Kubernetes waits out the whole grace period before killing it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from tests.integration.helpers import wait_until


def test_sigterm_stops_the_encoder_at_once_and_cleanly(tmp_path):
    address = tmp_path / "encoder.sock"
    env = {**os.environ, "PRISM_MODEL": str(ensure_demo_model(RANDOM_MODEL)), "PRISM_ENCODER__ADDRESS": f"ipc://{address}"}
    with open(tmp_path / "encoder.log", "wb") as log:
        encoder = subprocess.Popen([sys.executable, "-m", "vision_encoder"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: address.exists() or encoder.poll() is not None, 120, "the encoder binds its socket")
        assert encoder.poll() is None, (tmp_path / "encoder.log").read_text()[-2000:]
        encoder.send_signal(signal.SIGTERM)
        assert encoder.wait(timeout=15) == 0  # the handler's exit; the default action would read -15
    finally:
        if encoder.poll() is None:
            encoder.kill()
