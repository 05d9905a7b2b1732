"""Entry point: python -m llm_engine [--config configs/cpu-demo.yaml]"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import zmq.asyncio

from llm_engine.config import EngineConfig
from llm_engine.service import EngineService
from common.config import exit_on_config_error, load_config
from common.logs import setup_logging
from common.supervisor import stop_with_supervisor

DEAD_SHUTDOWN_TIMEOUT_S = 5


async def serve(config: EngineConfig) -> int:
    """The exit code: 1 when vLLM's engine core died or stalled for good (restart me)."""
    # SIGTERM while vLLM starts: finish starting, then stop as if drained. Dying at once
    # would leave vLLM's engine core behind, which only notes a signal while it is built.
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop_requested.set)
    service = await EngineService.start(config, zmq.asyncio.Context.instance())
    loop.add_signal_handler(signal.SIGTERM, service.drain)
    if stop_requested.is_set():
        service.drain()
    await service.run_until_stopped()
    if service.dead_reason is None:
        service.engine.shutdown()
        return 0
    service.engine.shutdown(timeout=DEAD_SHUTDOWN_TIMEOUT_S)  # a stopped engine core is killed, not waited for
    return 1


def main() -> None:
    stop_with_supervisor()
    parser = argparse.ArgumentParser(description="Prism LLM engine service (vLLM)")
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args()
    setup_logging("engine")
    sys.exit(exit_on_config_error(lambda: asyncio.run(serve(load_config(EngineConfig, "engine", args.config)))))


if __name__ == "__main__":
    main()
