"""Entry point: python -m gateway [--config configs/cpu-demo.yaml]

With `gateway.workers` > 1 this process supervises that many gateway workers
(gateway/ops/workers.py); each of them comes back here with its slot set."""

from __future__ import annotations

from gateway.hangups import hold_hangups

# First, before the imports below take their time: a SIGHUP while starting reloads once
# serving (a supervisor of workers passes it on), where its default would kill the process.
hold_hangups()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.ops.workers import serve_workers, this_worker  # noqa: E402
from common.config import load_config  # noqa: E402
from common.logs import setup_logging  # noqa: E402
from common.supervisor import stop_with_supervisor  # noqa: E402


def main() -> None:
    stop_with_supervisor()  # a worker of a multi-worker gateway
    parser = argparse.ArgumentParser(description="Prism gateway (OpenAI-compatible HTTP API)")
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args()
    setup_logging("gateway")
    config = load_config(GatewayConfig, "gateway", args.config)
    slot, run_dir = this_worker(config)
    if config.workers > 1 and run_dir is None:
        sys.exit(serve_workers(config, args.config))  # without the app's imports (torch): its memory is the workers'
    else:
        from gateway.api.app import serve

        serve(config, args.config, slot, run_dir)


if __name__ == "__main__":
    main()
