"""One Prism stack and one vLLM reference run per test session, launched as soon as collection
shows a test that needs them (tests/integration/prestart.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from testing.stack import LocalStack
from tests.integration.cases import TEST_MAX_PIXELS, TEST_MIN_PIXELS
from tests.integration.prestart import Reference, ReferenceRunner, SessionStack

MODEL_NAME = "prism-demo"
MAX_IMAGE_BYTES = 4_000_000
MAX_BODY_BYTES = 12_000_000
MAX_VIDEO_BYTES = 1_000_000
MAX_VIDEO_FRAME_PIXELS = 1_000_000
MAX_VIDEO_SAMPLED_FRAMES = 16
ALLOWED_LOOPBACK = "127.0.0.2"  # served by the fetch tests' image server; 127.0.0.1 stays refused

# float32 on both sides for parity; the test budget makes the gateway downscale.
STACK_OVERRIDES = {
    "PRISM_ENCODER__DTYPE": "float32",
    "PRISM_ENGINE__DTYPE": "float32",
    "PRISM_ENCODER__MAX_PIXELS": str(TEST_MAX_PIXELS),
    "PRISM_ENCODER__MIN_PIXELS": str(TEST_MIN_PIXELS),
    "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256",
    # Intake limits small enough to test cheaply.
    "PRISM_GATEWAY__MAX_IMAGE_BYTES": str(MAX_IMAGE_BYTES),
    "PRISM_GATEWAY__MAX_BODY_BYTES": str(MAX_BODY_BYTES),
    "PRISM_GATEWAY__MAX_VISUAL_TOKENS_PER_REQUEST": "1024",
    "PRISM_GATEWAY__DETAIL_LOW_MAX_PIXELS": "50176",
    # Video limits small enough to test cheaply (tests/integration/test_video_intake.py).
    "PRISM_GATEWAY__MAX_VIDEO_BYTES": str(MAX_VIDEO_BYTES),
    "PRISM_GATEWAY__MAX_VIDEO_FRAME_PIXELS": str(MAX_VIDEO_FRAME_PIXELS),
    "PRISM_GATEWAY__MAX_VIDEO_SAMPLED_FRAMES": str(MAX_VIDEO_SAMPLED_FRAMES),
    # The SSRF guard stays on; one loopback address is opted in for the fetch tests.
    "PRISM_GATEWAY__FETCH_ALLOWED_NETWORKS": f"[{ALLOWED_LOOPBACK}/32]",
    "PRISM_GATEWAY__FETCH_READ_TIMEOUT_S": "2",
    "PRISM_GATEWAY__FETCH_TOTAL_TIMEOUT_S": "4",
    # Parity: vLLM decodes every JPEG in full (the CPU demo config drafts them).
    "PRISM_GATEWAY__JPEG_DRAFT": "false",
}

# The stacks a test module starts for itself run vLLM with the model in its
# engine core ("uni"): one process fewer to import vLLM into at every engine
# start, with the same answers (docs/measurements/test-suite.md). The
# session's stack, tests/faults/test_faults' and test_demo_model's (`make serve` as it
# runs) keep vLLM's CPU default, a worker process of its own, so that shape
# stays tested under load and under kills.
ONE_PROCESS_ENGINE = {"PRISM_ENGINE__DISTRIBUTED_EXECUTOR_BACKEND": "uni"}


_SESSION = pytest.StashKey[SessionStack]()
# A test that asks for any of these (directly or through its fixtures) needs the session's stack.
_NEEDS_SESSION_STACK = {"_started", "stack", "reference", "client"}


def session_stack(config: pytest.Config) -> SessionStack:
    """The session's stack and reference runner (tests/integration/prestart.py), made once."""
    if _SESSION not in config.stash:
        runner = ReferenceRunner()
        config.stash[_SESSION] = session = SessionStack(config._tmp_path_factory, runner, STACK_OVERRIDES)
        config.add_cleanup(runner.stop)  # also when no test got to use them (an interrupted run)
        config.add_cleanup(session.stop)
    return config.stash[_SESSION]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start what the collected tests will need, in the order they need it: the session's stack and
    reference, then what each module's `prestart(config, its items)` queues (test_families: its references)."""
    if session.config.option.collectonly:
        return
    if any(_NEEDS_SESSION_STACK & set(getattr(item, "fixturenames", ())) for item in session.items):
        session_stack(session.config).launch()
    by_module: dict[object, list[pytest.Item]] = {}
    for item in session.items:
        if hasattr(getattr(item, "module", None), "prestart"):
            by_module.setdefault(item.module, []).append(item)
    for module, items in by_module.items():
        module.prestart(session.config, items)


@pytest.fixture(scope="session")
def images(pytestconfig) -> dict[str, Path]:
    return session_stack(pytestconfig).images


@pytest.fixture(scope="session")
def _started(pytestconfig):
    return session_stack(pytestconfig).started()


@pytest.fixture(scope="session")
def stack(_started) -> LocalStack:
    return _started[0]


@pytest.fixture(scope="session")
def reference(_started) -> Reference:
    return _started[1]


@pytest.fixture(scope="session")
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
