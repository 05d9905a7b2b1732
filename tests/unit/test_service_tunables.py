"""The launcher's glibc malloc settings for its services, and what they buy:
a freed block of megabytes is reused without page faults."""

import os
import platform
import subprocess
import sys

import pytest

from gateway.config import GatewayConfig
from prism.demo_model import SHAPES_MODEL
from prism.launch import SERVICE_TUNABLES, service_children

# A block of SIZE bytes written and freed on a worker thread (where the encoder's preprocessing and ViT allocate),
# then another written: prints the minor page faults the second one took.
SECOND_BLOCK_FAULTS = """
import ctypes, resource, sys, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = int(sys.argv[1])

def probe():
    first = libc.malloc(size); libc.memset(first, 1, size); libc.free(first)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    second = libc.malloc(size); libc.memset(second, 1, size)
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

thread = threading.Thread(target=probe); thread.start(); thread.join()
"""
TOKENS_7B = 1334 * 3584 * 2  # one megapixel image's visual tokens at Qwen2.5-VL-7B widths, bf16: 9.56 MB
PIXEL_VALUES_BATCH = 4 * 5376 * 1176 * 4  # four 1 MP images' float32 pixel values as the Qwen processors make them: 101 MB
PREVIOUS_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def _config() -> GatewayConfig:
    return GatewayConfig(models={"chat": {"encoder_addresses": ["ipc:///tmp/e.sock"], "engine_addresses": ["ipc:///tmp/g.sock"],
                                          "checkpoint": str(SHAPES_MODEL)}})


def test_encoder_and_engine_get_the_tunables(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    children = service_children(_config(), None, str(SHAPES_MODEL))
    assert sorted(child.module for child in children) == ["llm_engine", "vision_encoder"]
    assert all(child.env["GLIBC_TUNABLES"] == SERVICE_TUNABLES for child in children)


def test_a_users_own_tunables_are_kept(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert all(child.env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
               for child in service_children(_config(), None, str(SHAPES_MODEL)))


def _second_block_faults(size: int, tunables: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | ({"GLIBC_TUNABLES": tunables} if tunables else {})
    return int(subprocess.run([sys.executable, "-c", SECOND_BLOCK_FAULTS, str(size)], env=env, capture_output=True,
                              text=True, check=True).stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
@pytest.mark.parametrize("size", [TOKENS_7B, PIXEL_VALUES_BATCH], ids=["tokens-9.56MB", "pixel-values-101MB"])
def test_with_the_tunables_a_freed_block_is_reused_without_faults(size):
    pages = size // 4096
    assert _second_block_faults(size, None) > pages * 0.9  # the default: a fresh mapping, every page faulted in
    assert _second_block_faults(size, SERVICE_TUNABLES) < pages * 0.05


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
def test_a_block_over_a_threads_heap_was_mapped_afresh_with_the_previous_tunables():
    """What arena_max=1 and mmap_max=0 add: a worker thread's block of over 64 MB (its own heap's limit) was
    mapped, and faulted in, every time."""
    pages = PIXEL_VALUES_BATCH // 4096
    assert _second_block_faults(PIXEL_VALUES_BATCH, PREVIOUS_TUNABLES) > pages * 0.9


def test_the_image_sets_the_same_tunables():
    from common.config import REPO_ROOT

    assert f"GLIBC_TUNABLES={SERVICE_TUNABLES}\n" in (REPO_ROOT / "docker" / "Dockerfile").read_text()
