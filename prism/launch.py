"""Start the whole stack on one machine: encoder and engine as child processes,
the gateway in this one. The gateway's start-up handshake is the readiness
signal: it returns only when both services have answered.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import subprocess
import sys
from pathlib import Path

from prism.config import DEFAULT_CONFIG, REPO_ROOT, load_config
from prism.demo_model import ensure_demo_model
from prism.logs import setup_logging

DEMO_MODEL = REPO_ROOT / "models" / "prism-demo-qwen2vl"


def _spawn(module: str, config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, "--config", str(config)],
        cwd=REPO_ROOT,
        start_new_session=True,  # our Ctrl-C is handled here, then passed on
    )


def _stop(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)


def serve(config_path: Path) -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from vision_encoder.config import EncoderConfig

    setup_logging("gateway")  # the gateway runs in this process
    gateway_config = load_config(GatewayConfig, "gateway", config_path)
    if Path(load_config(EncoderConfig, "encoder", config_path).model) == DEMO_MODEL:
        ensure_demo_model(DEMO_MODEL)
    children = [_spawn("vision_encoder", config_path), _spawn("llm_engine", config_path)]
    atexit.register(_stop, children)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(create_app(gateway_config), host=gateway_config.host, port=gateway_config.port, log_level="warning")


def main() -> None:
    parser = argparse.ArgumentParser(prog="prism", description="Prism: split-encoder VLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cmd = sub.add_parser("serve", help="start gateway, vision encoder and LLM engine")
    serve_cmd.add_argument("--config", type=Path, default=Path(os.environ.get("PRISM_CONFIG", DEFAULT_CONFIG)))
    demo_cmd = sub.add_parser("demo-model", help="write the demo checkpoint")
    demo_cmd.add_argument("--out", type=Path, default=DEMO_MODEL)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.config.resolve())
    else:
        from prism.demo_model import write_demo_model

        print(write_demo_model(args.out))


if __name__ == "__main__":
    main()
