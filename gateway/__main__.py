"""Entry point: python -m gateway [--config configs/cpu-demo.yaml]"""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway.app import serve
from gateway.config import GatewayConfig
from common.config import load_config
from common.logs import setup_logging


def main() -> None:
    parser = argparse.ArgumentParser(description="Prism gateway (OpenAI-compatible HTTP API)")
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args()
    setup_logging("gateway")
    config = load_config(GatewayConfig, "gateway", args.config)
    serve(config)


if __name__ == "__main__":
    main()
