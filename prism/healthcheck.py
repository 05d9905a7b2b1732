"""Container health checks: exit 0 when the service answers, 1 otherwise.

  python -m prism.healthcheck encoder   # Hello over its ZMQ socket → EncoderReady
  python -m prism.healthcheck engine    # Hello → EngineReady
  python -m prism.healthcheck gateway   # GET /health/ready → 200

Each reads its section of the same config file the service does (PRISM_CONFIG,
or `--config` as the service was given it), so the check asks exactly where
the service listens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import zmq

from common.config import PROBE, load_config
from protocol.base import PROTOCOL, Hello
from protocol.sockets import pack
from protocol.to_gateway import EncoderReady, EngineReady, GatewayInbound


def local_address(bind: str) -> str:
    """Where to reach a service bound to `bind` from inside its own container."""
    return bind.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")


def service_answers(address: str, expected: type, timeout_s: float) -> bool:
    import msgspec

    ctx = zmq.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        socket.send_multipart(pack(Hello("healthcheck", PROTOCOL)))
        if not socket.poll(int(timeout_s * 1000)):
            return False
        header, *_ = socket.recv_multipart()
        return isinstance(msgspec.msgpack.decode(header, type=GatewayInbound), expected)
    finally:
        socket.close()
        ctx.term()


# A gateway bound to every address answers on loopback.
LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def ready_url(host: str, port: int) -> httpx.URL:
    """The gateway's readiness URL where it listens (an IPv6 address in brackets)."""
    return httpx.URL(scheme="http", host=LOOPBACK.get(host, host), port=port, path="/health/ready")


def gateway_ready(host: str, port: int, timeout_s: float) -> bool:
    try:
        return httpx.get(ready_url(host, port), timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("service", choices=("encoder", "engine", "gateway"))
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--config", type=Path, default=None, help="the service's config file (default: PRISM_CONFIG)")
    args = parser.parse_args()
    if args.service == "gateway":
        from gateway.config import GatewayConfig

        config = load_config(GatewayConfig, "gateway", args.config, context=PROBE)
        ok = gateway_ready(config.host, config.port, args.timeout_s)
    elif args.service == "encoder":
        from vision_encoder.config import EncoderConfig

        ok = service_answers(local_address(load_config(EncoderConfig, "encoder", args.config, context=PROBE).address), EncoderReady, args.timeout_s)
    else:
        from llm_engine.config import EngineConfig

        ok = service_answers(local_address(load_config(EngineConfig, "engine", args.config, context=PROBE).address), EngineReady, args.timeout_s)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
