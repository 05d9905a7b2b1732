"""Entry point: python -m vision_encoder [--config configs/cpu-demo.yaml]"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import zmq

from common.config import load_config
from common.logs import setup_logging
from vision_encoder.config import EncoderConfig
from vision_encoder.service import EncoderService


def main() -> None:
    parser = argparse.ArgumentParser(description="Prism vision encoder service")
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args()
    setup_logging("encoder")
    config = load_config(EncoderConfig, "encoder", args.config)
    logging.getLogger("prism.encoder").info("config: %s", config.model_dump())
    # A container's first process ignores SIGTERM unless it handles it (Kubernetes would
    # wait out the grace period, then kill): stop at once. The gateway sends the encodes
    # it had here to another replica, as for an encoder that died.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    EncoderService.start(config, zmq.Context.instance()).run_forever(wake_on_signals=True)


if __name__ == "__main__":
    main()
