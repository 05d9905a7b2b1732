"""Entry point: python -m llm_engine [--config configs/cpu-demo.yaml]"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import zmq.asyncio

from llm_engine.config import EngineConfig
from llm_engine.service import EngineService
from prism.config import load_config
from prism.logs import setup_logging


async def serve(config: EngineConfig) -> None:
    service = await EngineService.start(config, zmq.asyncio.Context.instance())
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, service.drain)
    await service.run_until_drained()
    service.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description="Prism LLM engine service (vLLM)")
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args()
    setup_logging("engine")
    asyncio.run(serve(load_config(EngineConfig, "engine", args.config)))


if __name__ == "__main__":
    main()
