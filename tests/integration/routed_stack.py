"""The stack of tests/integration/test_models.py and tests/faults/test_engine_replicas.py:
model `prism-demo` has two encoder and two engine replicas over tcp://;
`prism-demo-b` is another checkpoint (another seed) with its own encoder and
engine, all behind one gateway routed by `gateway.models`."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
import yaml

from common.config import DEFAULT_CONFIG
from prism.demo_model import RANDOM_MODEL, write_demo_model
from testing.stack import LocalStack, free_port
from loadtest.synthetic import make_image
from tests.integration.conftest import ONE_PROCESS_ENGINE
from tests.integration.corpus import b64, save
from tests.integration.helpers import engine_pid, scrape

MAIN, OTHER, ALIAS = "prism-demo", "prism-demo-b", "prism-demo-alias"
ENGINE_FAILOVERS = ("prism_replica_failovers_total", (("service", "engine"),))


def tcp_addresses(count: int) -> list[str]:
    return [f"tcp://127.0.0.1:{free_port()}" for _ in range(count)]


@pytest.fixture(scope="module", name="routed")
def routed_fixture(tmp_path_factory):
    """The stack, started once for each module that imports this fixture (it asks for `routed`)."""
    with routed_stack(tmp_path_factory.mktemp("models")) as stack:
        yield stack


@contextlib.contextmanager
def routed_stack(run_dir: Path):
    """The stack, started."""
    # seed 7: greedy decoding of a story prompt runs for hundreds of tokens (no early end-of-sequence),
    # so an engine stopped under load is sure to hold requests
    main_checkpoint = write_demo_model(run_dir / "prism-demo-seed7", seed=7)
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for single_route in ("encoder_addresses", "engine_addresses", "served_model_name"):  # `models` replaces them
        config["gateway"].pop(single_route, None)
    config["gateway"].update(stats_interval_s=0.5, models={
        MAIN: {"checkpoint": str(main_checkpoint), "encoder_addresses": tcp_addresses(2), "engine_addresses": tcp_addresses(2)},
        OTHER: {"encoder_addresses": [f"ipc://{run_dir}/b-encoder.sock"], "engine_addresses": [f"ipc://{run_dir}/b-engine.sock"]},
    })
    config["engine"].update(kv_cache_memory_mb=256, drain_timeout_s=60)
    config["model"] = str(RANDOM_MODEL)
    path = run_dir / "models.yaml"
    path.write_text(yaml.safe_dump(config))
    stack = LocalStack(run_dir, {"PRISM_CONFIG": str(path), **ONE_PROCESS_ENGINE}, routed_by_config=True)
    stack.start(timeout_s=600)
    stack.config_path = path
    try:
        yield stack
    finally:
        stack.stop()


def chat(stack: LocalStack, model: str, content, max_tokens: int = 6, **extra) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)


def with_image(url: str, question: str = "What is it?") -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]


def image(name: str, size=(320, 240)) -> str:
    return b64(save(make_image(name, size), "JPEG"))


def engine_requests(stack: LocalStack) -> list[float]:
    found = scrape(stack)
    return [found.get(("prism_engine_replica_requests_total", (("model", MAIN), ("replica", str(i)))), 0.0) for i in range(2)]


def per_engine(stack: LocalStack, name: str) -> list[float]:
    found = scrape(stack)
    return [found.get((name, (("model", MAIN), ("replica", str(i)))), 0.0) for i in range(2)]


def both_engines_up(stack: LocalStack) -> bool:
    return per_engine(stack, "prism_engine_replica_up") == [1.0, 1.0]


def restarted_and_serving(stack: LocalStack, address: str, old_pid: int) -> bool:
    """The launcher runs a new engine at `address` and the gateway counts both engines up.
    Both up alone is no proof: the gateway counts the old process up until it
    notices it gone, and a draining one until it exits."""
    return engine_pid(stack, address) not in (None, old_pid) and both_engines_up(stack)


def gateway_in_flight(stack: LocalStack) -> float:
    return scrape(stack).get(("prism_in_flight_requests", (("service", "gateway"),)), 0.0)
