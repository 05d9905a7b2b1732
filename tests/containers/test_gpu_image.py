"""The GPU flavour's image, built and checked on a machine without a GPU.
Opt-in: `PRISM_TEST_GPU_IMAGE=1 make test-containers` (it downloads upstream
vLLM's CUDA wheels, gigabytes of them; size and build time in
docs/measurements/containers.md).

What a GPU host meets first: on CUDA, Triton compiles a C launcher for each
kernel it runs (vLLM's, the encoder's compiled blocks) with the system's
compiler against Python's headers. The CPU flavour's image has no compiler
and must fail that same step; the GPU flavour's must pass it."""

from __future__ import annotations

import os
import re
import time

import pytest

from common.config import REPO_ROOT
from tests.containers.build import IMAGE
from tests.containers.daemon import docker, image_size
from tests.containers.figures import FIGURES

GPU_IMAGE = "prism:gpu"  # docker-compose.gpu.yml's
CHECKS = REPO_ROOT / "tests" / "containers"  # triton_launcher.py, vllm_sampler.py: run inside the images
PRISM_RUNS = ("torch", "torchvision", "transformers", "tokenizers", "safetensors", "numpy", "pillow",
              "opencv-python-headless", "triton")
SOURCE = "PYTHONPATH=/opt/prism"  # the image's copy of the repository, for scripts that import Prism

pytestmark = [
    pytest.mark.skipif(not os.environ.get("PRISM_TEST_GPU_IMAGE"), reason="opt-in: PRISM_TEST_GPU_IMAGE=1"),
    pytest.mark.timeout(3600),
]


@pytest.fixture(scope="module")
def gpu_image(built) -> str:
    started = time.monotonic()
    docker("build", "-q", "-f", "docker/Dockerfile", "--build-arg", f"BASE_IMAGE={built.base}",
           "--build-arg", "FLAVOUR=gpu", "-t", GPU_IMAGE, str(REPO_ROOT), timeout_s=3600)
    FIGURES["gpu_image_s"], FIGURES["gpu_image_bytes"] = time.monotonic() - started, image_size(GPU_IMAGE)
    return GPU_IMAGE


def run(image: str, *command: str, env: tuple[str, ...] = ()) -> str:
    """`command` in the image as its own user, with no network; the checks' scripts in /checks."""
    return docker("run", "--rm", "--network", "none", "-v", f"{CHECKS}:/checks:ro", *(f"--env={e}" for e in env),
                  image, *command, timeout_s=300)


def test_triton_builds_a_launcher_in_the_gpu_image_and_not_in_the_cpu_image(gpu_image):
    assert re.fullmatch(r"cuda_utils\.cpython-\d+-x86_64-linux-gnu\.so", run(gpu_image, "python", "/checks/triton_launcher.py").strip())
    failed = run(IMAGE, "sh", "-c", "python /checks/triton_launcher.py 2>&1; true")
    assert "Failed to find C compiler" in failed, failed[-500:]


def test_vllm_samples_with_its_own_sampler_where_flashinfer_cannot_build_its_kernels(gpu_image):
    # vLLM's choice on an H100 (its GPU answers stood in) once the engine
    # service prepared the environment: its own sampler, as FlashInfer's
    # kernels need an nvcc the image lacks (left to vLLM's default, FlashInfer's,
    # and the engine's start-up sampling run would fail). A deployment that
    # asks for FlashInfer's keeps it.
    sampler = ("python", "/checks/vllm_sampler.py")
    assert run(gpu_image, *sampler, env=(SOURCE,)).split()[-2:] == ["False", "False"]
    asked = run(gpu_image, *sampler, env=(SOURCE, "VLLM_USE_FLASHINFER_SAMPLER=1"))
    assert asked.split()[-2:] == ["False", "True"]


def pins(text: str) -> dict[str, str]:
    """name -> version of every `name==version` (or `===`) line; names as pip normalises them."""
    found = (re.match(r"([A-Za-z0-9_.-]+)\s*===?\s*([^\s#;]+)", line) for line in text.splitlines())
    return {re.sub(r"[-_.]+", "-", m[1]).lower(): m[2] for m in found if m}


def test_the_gpu_image_runs_its_lock_and_the_cpu_lock_s_versions_of_what_prism_runs(gpu_image):
    installed = pins(run(gpu_image, "pip", "freeze", "--all", "--exclude", "pip", "--exclude", "setuptools"))
    gpu, cpu = (pins((REPO_ROOT / "requirements" / f"{lock}.lock").read_text()) for lock in ("gpu", "cpu"))
    assert installed == gpu, {name: (installed.get(name), gpu.get(name)) for name in installed.keys() | gpu.keys()
                              if installed.get(name) != gpu.get(name)}
    # What Prism's own code runs (the towers, preprocessing, video decode): as tested on the CPU.
    assert {name: gpu[name] for name in PRISM_RUNS} == {name: cpu[name] for name in PRISM_RUNS}


def test_the_compile_caches_are_empty_and_writable_by_the_image_s_user(gpu_image):
    listing = run(gpu_image, "sh", "-c", 'for d in "$TORCHINDUCTOR_CACHE_DIR" "$VLLM_CACHE_ROOT"; do'
                  ' mkdir -p "$d" && touch "$d/probe" && echo "$d"; done; find /var/cache/prism -type f | wc -l')
    *caches, files = listing.split()
    assert caches == ["/var/cache/prism/torchinductor", "/var/cache/prism/vllm"] and files == "2", listing
