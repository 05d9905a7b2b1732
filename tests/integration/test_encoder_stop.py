"""The encoder stops on SIGTERM by its own handler (exit status 0), as a
container's first process must: without one, Linux ignores SIGTERM for a
PID 1 and Kubernetes waits out the whole grace period before killing it."""

from __future__ import annotations

import signal

from tests.integration.encoder_socket import encoder_process
from tests.integration.helpers import wait_until


def test_sigterm_stops_the_encoder_at_once_and_cleanly(tmp_path):
    with encoder_process(tmp_path) as encoder:
        socket = tmp_path / "encoder.sock"
        wait_until(lambda: socket.exists() or encoder.process.poll() is not None, 120, "the encoder binds its socket")
        assert encoder.process.poll() is None, encoder.log.read_text()[-2000:]
        encoder.process.send_signal(signal.SIGTERM)
        assert encoder.process.wait(timeout=15) == 0  # the handler's exit; the default action would read -15
