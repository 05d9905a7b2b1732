"""Start the whole stack on one machine: encoder, engine and gateway as supervised
child processes (common/supervisor.py), or the gateway's worker processes
supervised from here when `gateway.workers` > 1. The gateway decodes what
clients send (images, videos, native decoders among them): in a process of its
own, one that crashes is restarted like any service, where in this one it took
every service down with it. The gateway's start-up handshake is the readiness
signal: it serves only once both services have answered.

A child that dies is restarted with exponential back-off. The gateway notices
the outage through its heartbeats and the return through the next answer;
nothing here talks to it.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from common.config import DEFAULT_CONFIG, EXIT_CONFIG, PROBE, ConfigError, configured_model, load_config, resolve_model
from common.malloc import HEAP_KEPT_TUNABLES
from common.supervisor import Child, Supervisor, kill_group
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.gpu_shares import check_gpu_shares
from prism.healthcheck import local_address, service_answers
from protocol.to_gateway import EncoderReady, EngineReady
from common.logs import setup_logging

log = logging.getLogger("prism.launcher")


def takes_images(checkpoint: str) -> bool:
    from transformers import AutoConfig

    from common.families import UnsupportedModel, family_of

    try:
        return family_of(AutoConfig.from_pretrained(checkpoint)).takes_images
    except UnsupportedModel as exc:
        raise SystemExit(f"{checkpoint}: {exc}") from None


# glibc's malloc settings for the services `prism serve` starts, so that memory a service has freed is reused
# rather than mapped afresh: every fresh page costs a fault, which for blocks of megabytes per image costs more than
# the work done on them. A GLIBC_TUNABLES of the user's own is kept as it is. docs/architecture.md, "Memory and
# malloc"; the runs: docs/measurements/handoff.md and docs/measurements/profiling.md.
# The engine (and vLLM's processes): blocks of up to 32 MB come from the heap (mmap_threshold), and the heap is kept
# when they are freed (trim_threshold). Every new image's visual tokens then land in reused pages, where otherwise
# each of their pages would be faulted in afresh.
# The gateway, in this process, sets the same at start-up (common/malloc.py).
ENGINE_TUNABLES = HEAP_KEPT_TUNABLES
# The encoder: blocks of any size. A batch's pixel values are 25 MB of float32 per megapixel image, stacked and then
# concatenated, and the ViT's activations for a batch are as big: with the engine's setting every block over 32 MB
# was mapped afresh and faulted in, page by page, for every batch. mmap_max=0: no block gets a mapping of its own;
# arena_max=1: one heap for every thread, since a thread's own heap holds at most 64 MB and a bigger block would be
# mapped anyway.
ENCODER_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=1073741824"


PROBE_TIMEOUT_S = 5.0  # a service's answer to the supervisor's Hello (gateway.child_liveness_s)


def answers_on(address: str, expected: type) -> Callable[[], bool]:
    """The supervisor's liveness probe for the service bound to `address`: a Hello, answered."""
    return partial(service_answers, local_address(address), expected, PROBE_TIMEOUT_S)


def service_children(gateway_config, config_path: Path, shared_model: str | None) -> list[Child]:
    """One encoder per encoder address and one engine per engine address of every
    served model (an address shared by several names starts once), each told
    its address and its model's checkpoint."""
    children: dict[str, Child] = {}
    encoder_tunables = os.environ.get("GLIBC_TUNABLES", ENCODER_TUNABLES)
    engine_tunables = os.environ.get("GLIBC_TUNABLES", ENGINE_TUNABLES)
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
            child_env = {**env, "PRISM_ENCODER__ADDRESS": address, "GLIBC_TUNABLES": encoder_tunables}
            children.setdefault(address, Child("vision_encoder", config_path, child_env, f"vision_encoder[{label}:{i}]",
                                               probe=answers_on(address, EncoderReady)))
        for i, address in enumerate(route.engine_addresses):
            child_env = {**env, "PRISM_ENGINE__ADDRESS": address, "GLIBC_TUNABLES": engine_tunables,
                         **({"PRISM_ENGINE__SERVED_MODEL_NAME": name} if name else {})}
            children.setdefault(address, Child("llm_engine", config_path, child_env, f"llm_engine[{label}:{i}]",
                                               probe=answers_on(address, EngineReady)))
    return list(children.values())


def check_service_configs(children: list[Child]) -> list:
    """Every child's section validated here first, as the child will load it (its file, its
    environment): a bad value stops `prism serve` at once, naming the key, instead of a child
    that fails at start-up and is restarted until the gateway's start-up timeout gives up.
    Checks that need vLLM or the checkpoint (a parser's name) are the child's own: it exits
    with EXIT_CONFIG, and `prism serve` stops (`Supervisor.on_refused`). The configs, in the
    children's order."""
    from llm_engine.config import EngineConfig
    from vision_encoder.config import EncoderConfig

    sections = {"vision_encoder": (EncoderConfig, "encoder"), "llm_engine": (EngineConfig, "engine")}
    loaded = []
    for child in children:
        model, section = sections[child.module]
        env = {**os.environ, **child.env}
        loaded.append((child.name, load_config(model, section, child.config, env=env, context=PROBE), env))
    check_gpu_shares(loaded)
    return [config for _, config, _ in loaded]


STOP_MARGIN_S = 15  # past an engine's drain: vLLM's own shutdown
GATEWAY_STOP_MARGIN_S = 5  # past the gateway's drain: its clients' sockets closed


def serve(config_path: Path) -> None:
    from gateway.config import GatewayConfig

    from gateway.hangups import hold_hangups, take_pending

    # SIGHUP reloads the routing map once the gateway serves, one that comes sooner included;
    # its default would kill this process (and leave its children without the atexit stop)
    hold_hangups()
    setup_logging("gateway")  # this process speaks for the gateway it starts (or its workers)
    try:
        gateway_config = load_config(GatewayConfig, "gateway", config_path)
        # the top-level model (or PRISM_MODEL), needed only where a route names no checkpoint of its own
        shared = None
        if any(route.checkpoint is None for route in gateway_config.routes().values()):
            shared = configured_model(config_path)
        children = service_children(gateway_config, config_path, shared)
        configs = check_service_configs(children)
    except ConfigError as exc:
        raise SystemExit(f"prism serve: {exc}") from None
    refused: list[str] = []

    def stop_refused(child) -> None:  # the supervisor's thread: the gateway's signal stops it as Ctrl-C would
        refused.append(child.label)
        os.kill(os.getpid(), signal.SIGTERM)

    def exit_status() -> int:
        if refused:
            log.error("prism serve: %s refused its configuration (its log above names the key)", ", ".join(refused))
        return EXIT_CONFIG if refused else 0

    supervisor = Supervisor(children, liveness_s=gateway_config.child_liveness_s, on_refused=stop_refused)
    # An engine finishes what it holds (engine.drain_timeout_s), then shuts vLLM down; killed
    # sooner, vLLM's processes leave their shared-memory queues in /dev/shm.
    grace_s = max((getattr(config, "drain_timeout_s", 0) for config in configs), default=0) + STOP_MARGIN_S

    # One gateway: a child of its own, stopped first (it drains its requests while the services serve them).
    gateway = Child("gateway", config_path, name="gateway") if gateway_config.workers == 1 else None
    if gateway is not None:
        supervisor.children.append(gateway)
    gateway_grace_s = gateway_config.drain_timeout_s + GATEWAY_STOP_MARGIN_S

    def stop_children() -> None:
        # A second Ctrl-C or SIGTERM meanwhile would end this stop half-way, its children left running.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: log.warning("prism serve: stopping the services already (up to %.0f s)", grace_s))
        supervisor.stop(grace_s, first=gateway, first_grace_s=gateway_grace_s)

    # From here a SIGTERM stops the children (atexit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(exit_status()))
    atexit.register(stop_children)  # before the first child: one stopped while the others spawn is stopped too
    supervisor.start()
    if gateway is None:
        from gateway.ops.workers import serve_workers

        if serve_workers(gateway_config, config_path) == EXIT_CONFIG:  # returns on SIGTERM, once the workers have drained
            refused.append("the gateway")
        sys.exit(exit_status())
    # SIGHUP reloads the gateway's routing map: passed on to it alone (a service's default would end it);
    # one that came while this process started too (the gateway holds it until it serves).
    signal.signal(signal.SIGHUP, lambda *_: kill_group(gateway.process, signal.SIGHUP))
    if take_pending():
        kill_group(gateway.process, signal.SIGHUP)
    signal.signal(signal.SIGINT, lambda *_: sys.exit(exit_status()))  # Ctrl-C: the same stop, not a traceback
    while True:  # until a signal's handler exits
        signal.pause()


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
