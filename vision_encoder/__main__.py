"""Entry point: python -m vision_encoder [--config configs/cpu-demo.yaml]"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from pathlib import Path

import zmq

from common.config import exit_on_config_error, load_config
from common.logs import setup_logging
from common.supervisor import stop_with_supervisor
from vision_encoder.config import EncoderConfig
from vision_encoder.service import EncoderService


def wake_on_signals() -> tuple[socket.socket, socket.socket]:
    """(reader, writer): Python's C-level handler writes to `writer` on every
    signal (`signal.set_wakeup_fd`), from whichever thread the kernel gave it
    to. The kernel may give SIGTERM to a ViT or preprocessing thread; Python
    runs the handler only once the main thread runs again, and an idle
    encoder's main thread sleeps in its poll with no timeout, so SIGTERM went
    unheeded until the next message. Polling `reader` wakes it."""
    reader, writer = socket.socketpair()
    for end in (reader, writer):
        end.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    return reader, writer


def _stop_at_once(*_) -> None:
    logging.shutdown()  # what the handlers hold goes out first
    # Not sys.exit: the interpreter's shutdown waits for the worker threads' batches, a hung one for ever.
    os._exit(0)


def main() -> None:
    stop_with_supervisor()
    parser = argparse.ArgumentParser(description="Prism vision encoder service")
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args()
    setup_logging("encoder")
    config = exit_on_config_error(lambda: load_config(EncoderConfig, "encoder", args.config))
    logging.getLogger("prism.encoder").info("config: %s", config.model_dump())
    # A container's first process ignores SIGTERM unless it handles it (Kubernetes would
    # wait out the grace period, then kill): stop at once. The gateway sends the encodes
    # it had here to another replica, as for an encoder that died.
    signal.signal(signal.SIGTERM, _stop_at_once)
    service = exit_on_config_error(lambda: EncoderService.start(config, zmq.Context.instance()))
    service.signals, _writer = wake_on_signals()  # the writer stays open for the process's life
    service.run_forever()


if __name__ == "__main__":
    main()
