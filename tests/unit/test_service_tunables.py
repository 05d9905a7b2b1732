"""The launcher's glibc malloc settings for its services, and the gateway's
own (common/malloc.py), and what they buy: a freed block of megabytes is
reused without page faults."""

import os
import platform
import subprocess
import sys

import pytest

from gateway.config import GatewayConfig
from prism.demo_model import SHAPES_MODEL
from common.config import REPO_ROOT
from prism.launch import ENCODER_TUNABLES, ENGINE_TUNABLES, service_children

# A block of SIZE bytes written and freed on a worker thread (where the encoder's preprocessing and ViT allocate),
# then another written: prints the minor page faults the second one took. With `gateway`: on the main thread, after
# the gateway's own setting (common/malloc.py).
SECOND_BLOCK_FAULTS = """
import ctypes, resource, sys, threading
if sys.argv[2:] == ["gateway"]:
    from common.malloc import keep_freed_heap
    assert keep_freed_heap()
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

if sys.argv[2:] == ["gateway"]:
    probe()  # on the main thread, where the gateway's event loop reads bodies and parses them
else:
    thread = threading.Thread(target=probe); thread.start(); thread.join()
"""
TOKENS_7B = 1334 * 3584 * 2  # one megapixel image's visual tokens at Qwen2.5-VL-7B widths, bf16: 9.56 MB
PIXEL_VALUES_BATCH = 4 * 5376 * 1176 * 4  # four 1 MP images' float32 pixel values as the Qwen processors make them: 101 MB
BODY_4K = 1_296_150  # a request with one 4K JPEG as a data URL: its body, then its URL's string as parsed


def _config() -> GatewayConfig:
    return GatewayConfig(models={"chat": {"encoder_addresses": ["ipc:///tmp/e.sock"], "engine_addresses": ["ipc:///tmp/g.sock"],
                                          "checkpoint": str(SHAPES_MODEL)}})


def test_encoder_and_engine_get_the_tunables(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    children = service_children(_config(), None, str(SHAPES_MODEL))
    assert sorted(child.module for child in children) == ["llm_engine", "vision_encoder"]
    tunables = {child.module: child.env["GLIBC_TUNABLES"] for child in children}
    assert tunables == {"vision_encoder": ENCODER_TUNABLES, "llm_engine": ENGINE_TUNABLES}


def test_a_users_own_tunables_are_kept(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert all(child.env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
               for child in service_children(_config(), None, str(SHAPES_MODEL)))


def _second_block_faults(size: int, tunables: str | None, *args: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | ({"GLIBC_TUNABLES": tunables} if tunables else {})
    return int(subprocess.run([sys.executable, "-c", SECOND_BLOCK_FAULTS, str(size), *args], env=env, capture_output=True,
                              text=True, check=True, cwd=REPO_ROOT).stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
@pytest.mark.parametrize(("size", "tunables"), [(TOKENS_7B, ENGINE_TUNABLES), (TOKENS_7B, ENCODER_TUNABLES),
                                               (PIXEL_VALUES_BATCH, ENCODER_TUNABLES)],
                         ids=["engine-tokens-9.56MB", "encoder-tokens-9.56MB", "encoder-pixel-values-101MB"])
def test_with_the_tunables_a_freed_block_is_reused_without_faults(size, tunables):
    pages = size // 4096
    assert _second_block_faults(size, None) > pages * 0.9  # the default: a fresh mapping, every page faulted in
    assert _second_block_faults(size, tunables) < pages * 0.05


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
def test_the_engines_setting_maps_a_batch_of_pixel_values_afresh():
    """Why the encoder has its own: a worker thread's block of over 64 MB (its own heap's limit) was mapped, and
    faulted in, every time with the engine's."""
    pages = PIXEL_VALUES_BATCH // 4096
    assert _second_block_faults(PIXEL_VALUES_BATCH, ENGINE_TUNABLES) > pages * 0.9


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_the_gateway_keeps_a_freed_body_for_the_next():
    """The gateway runs in the launcher's process, where GLIBC_TUNABLES comes too late: it sets the engine's
    settings itself (mallopt), so a second 4K body lands in the pages the first one left."""
    pages = BODY_4K // 4096
    assert _second_block_faults(BODY_4K, None) > pages * 0.9  # glibc's defaults, on the main thread
    assert _second_block_faults(BODY_4K, None, "gateway") < pages * 0.05


def test_the_gateway_leaves_a_users_tunables_as_they_are(monkeypatch):
    from common.malloc import keep_freed_heap

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert keep_freed_heap() is False


def test_the_image_and_the_deployments_set_the_same_tunables():
    assert f"GLIBC_TUNABLES={ENGINE_TUNABLES}\n" in (REPO_ROOT / "docker" / "Dockerfile").read_text()
    assert f"GLIBC_TUNABLES: {ENCODER_TUNABLES}\n" in (REPO_ROOT / "docker-compose.yml").read_text()
    assert f'value: "{ENCODER_TUNABLES}"' in (REPO_ROOT / "deploy" / "kubernetes" / "model" / "encoder.yaml").read_text()


# 24 MB blocks (heap, not mmap: under the 32 MB threshold), each followed by a small one still in use: glibc keeps
# them when freed (not the heap's top). Printed: what RSS lost, in MB, at each free and each way of giving back.
FREED_BELOW_IN_USE = """
import asyncio, ctypes
from common.malloc import keep_freed_heap, trim
from gateway.intake.memory import HeapKeeper, MemoryBudget, MemoryPlan
keep_freed_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
budget = MemoryBudget()
budget.size(2**40)
keeper = HeapKeeper(MemoryPlan(limit=2**41, source="", at_start=rss(), budget=2**40, kept_heap=2**20), budget)
blocks = []
for _ in range(4):
    blocks.append(libc.malloc(24 << 20)); libc.memset(blocks[-1], 1, 24 << 20); libc.malloc(1 << 20)  # a block in use after it
def lost(step):
    before = rss(); step(); return (before - rss()) >> 20
check = lambda: asyncio.run(keeper.check())
def and_then(give_back):
    return lost(lambda: libc.free(blocks.pop(0))), lost(give_back)
results = [and_then(trim), and_then(check), and_then(check)]  # the third within TRIM_EVERY_S of the second
keeper.ceiling = 0
results.append(and_then(check))
print(*(given for freed, given in results), max(freed for freed, given in results))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_freed_heap_past_what_the_gateway_keeps_goes_back_to_the_kernel():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", FREED_BELOW_IN_USE], env=env, capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT).stdout.split()
    trimmed, past_kept, again_soon, past_ceiling, given_back_by_free = map(int, out)
    assert given_back_by_free == 0  # free() alone gives nothing back
    assert trimmed >= 23 and past_kept >= 23  # trim(); the keeper, past what it keeps
    assert again_soon <= 1  # not again within TRIM_EVERY_S while under the plan's ceiling
    assert past_ceiling >= 23  # past the ceiling, at every check
