"""Start the whole stack on one machine: encoder and engine as supervised child
processes, the gateway in this one. The gateway's start-up handshake is the
readiness signal: it serves only once both services have answered.

A child that dies is restarted with exponential back-off (its whole process
group is killed first: vLLM's engine-core process must not outlive it). The
gateway notices the outage through its heartbeats and the return through the
next answer; nothing here talks to it.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.config import DEFAULT_CONFIG, REPO_ROOT, configured_model, load_config, resolve_model
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from common.logs import setup_logging

log = logging.getLogger("prism.launcher")


def _kill_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Child:
    module: str
    config: Path
    env: dict[str, str] = field(default_factory=dict)  # overrides for this child (e.g. its address)
    name: str = ""
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 1.0

    def spawn(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, "--config", str(self.config)],
            cwd=REPO_ROOT,
            env={**os.environ, **self.env},
            start_new_session=True,  # its own process group, so it can be stopped whole
        )
        self.started_at = time.monotonic()
        log.info("started %s (pid %d)", self.label, self.process.pid)

    @property
    def label(self) -> str:
        return self.name or self.module


@dataclass
class Supervisor:
    children: list[Child]
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # a child up this long has its back-off reset
    _stopping: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        for child in self.children:
            child.spawn()
        threading.Thread(target=self._watch, name="supervisor", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            for child in self.children:
                if child.process.poll() is not None and not self._stopping.is_set():
                    self._restart(child)

    def _restart(self, child: Child) -> None:
        code = child.process.returncode
        _kill_group(child.process, signal.SIGKILL)  # leftovers (vLLM's engine core) go too
        if time.monotonic() - child.started_at > self.stable_after_s:
            child.backoff_s = 1.0
        log.error("%s exited with %s; restarting in %.0f s", child.label, code, child.backoff_s)
        if self._stopping.wait(child.backoff_s):
            return
        child.backoff_s = min(child.backoff_s * 2, self.max_backoff_s)
        child.restarts += 1
        child.spawn()

    def stop(self) -> None:
        self._stopping.set()
        for child in self.children:
            _kill_group(child.process, signal.SIGTERM)
        for child in self.children:
            try:
                child.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(child.process, signal.SIGKILL)


def takes_images(checkpoint: str) -> bool:
    from transformers import AutoConfig

    from common.families import UnsupportedModel, family_of

    try:
        return family_of(AutoConfig.from_pretrained(checkpoint)).takes_images
    except UnsupportedModel as exc:
        raise SystemExit(f"{checkpoint}: {exc}") from None


def service_children(gateway_config, config_path: Path, shared_model: str) -> list[Child]:
    """One encoder per encoder address and one engine per engine address of every
    served model (an address shared by several names starts once), each told
    its address and its model's checkpoint."""
    children: dict[str, Child] = {}
    for name, route in gateway_config.routes().items():
        checkpoint = resolve_model(route.checkpoint) if route.checkpoint else shared_model
        if Path(checkpoint) == RANDOM_MODEL:
            ensure_demo_model(RANDOM_MODEL)
        env = {"PRISM_MODEL": checkpoint}
        label = name or "default"
        if route.encoder_addresses and not takes_images(checkpoint):
            raise SystemExit(f"model {label} ({checkpoint}) is text-only: list no encoder addresses for it "
                             "(gateway.encoder_addresses: [], or none in its models entry)")
        for i, address in enumerate(route.encoder_addresses):
            child_env = {**env, "PRISM_ENCODER__ADDRESS": address}
            children.setdefault(address, Child("vision_encoder", config_path, child_env, f"vision_encoder[{label}:{i}]"))
        for i, address in enumerate(route.engine_addresses):
            child_env = {**env, "PRISM_ENGINE__ADDRESS": address, **({"PRISM_ENGINE__SERVED_MODEL_NAME": name} if name else {})}
            children.setdefault(address, Child("llm_engine", config_path, child_env, f"llm_engine[{label}:{i}]"))
    return list(children.values())


def serve(config_path: Path) -> None:
    from gateway.app import serve as serve_gateway
    from gateway.config import GatewayConfig

    setup_logging("gateway")  # the gateway runs in this process
    gateway_config = load_config(GatewayConfig, "gateway", config_path)
    children = service_children(gateway_config, config_path, configured_model(config_path))
    supervisor = Supervisor(children)
    supervisor.start()
    atexit.register(supervisor.stop)
    # uvicorn handles SIGTERM itself while it runs (stop accepting, drain, shut
    # down) and raises it again when done; this handler then runs atexit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve_gateway(gateway_config, config_path)


def main() -> None:
    parser = argparse.ArgumentParser(prog="prism", description="Prism: split-encoder VLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cmd = sub.add_parser("serve", help="start gateway, vision encoder and LLM engine")
    serve_cmd.add_argument("--config", type=Path, default=Path(os.environ.get("PRISM_CONFIG", DEFAULT_CONFIG)))
    demo_cmd = sub.add_parser("demo-model", help="write the demo checkpoint")
    demo_cmd.add_argument("--out", type=Path, default=RANDOM_MODEL)
    demo_cmd.add_argument("--seed", type=int, default=None, help="another seed: another model (same shapes)")
    sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (python -m loadtest --help)", add_help=False)
    args, rest = parser.parse_known_args()
    if args.command == "bench":
        from loadtest.__main__ import main as bench

        sys.exit(bench(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        serve(args.config.resolve())
    else:
        from prism.demo_model import write_demo_model

        print(write_demo_model(args.out, *([args.seed] if args.seed is not None else [])))


if __name__ == "__main__":
    main()
