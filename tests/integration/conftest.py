"""One Prism stack and one vLLM reference run per test session, started together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import LocalStack, log_tail
from tests.integration.cases import TEST_MAX_PIXELS, TEST_MIN_PIXELS, write_images

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
# session's stack, test_faults' and test_demo_model's (`make serve` as it
# runs) keep vLLM's CPU default, a worker process of its own, so that shape
# stays tested under load and under kills.
ONE_PROCESS_ENGINE = {"PRISM_ENGINE__DISTRIBUTED_EXECUTOR_BACKEND": "uni"}


class Reference:
    """The vLLM reference outputs, computed in a child process beside the stack."""

    def __init__(self, out: Path, images: Path, log: Path, model: Path = RANDOM_MODEL, videos: bool = False,
                 cases: list[str] | None = None) -> None:
        """`cases`: the names of cases.CASES to answer (all when None)."""
        self.out = out
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("reference_vllm.py")), str(model), str(images), str(out)]
            + (["--videos"] if videos else []) + (["--cases", ",".join(cases)] if cases is not None else []),
            cwd=REPO_ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        )
        self._results: dict | None = None

    def results(self) -> dict:
        if self._results is None:
            if self.process.wait(timeout=600) != 0:
                raise RuntimeError(f"vLLM reference run failed; the end of {self.log}:\n{log_tail(self.log)}")
            self._results = json.loads(self.out.read_text())
        return self._results

    def __getitem__(self, case: str) -> dict:
        return self.results()[case]


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> dict[str, Path]:
    return write_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def _started(tmp_path_factory, images):
    ensure_demo_model(RANDOM_MODEL)
    run_dir = tmp_path_factory.mktemp("stack")
    reference = Reference(run_dir / "reference.json", next(iter(images.values())).parent, run_dir / "reference.log")
    stack = LocalStack(run_dir, STACK_OVERRIDES)
    try:
        stack.start()
        yield stack, reference
    finally:
        stack.stop()
        if reference.process.poll() is None:
            reference.process.kill()


@pytest.fixture(scope="session")
def stack(_started) -> LocalStack:
    return _started[0]


@pytest.fixture(scope="session")
def reference(_started) -> Reference:
    return _started[1]


@pytest.fixture(scope="session")
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
