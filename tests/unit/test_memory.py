"""The gateway's memory budget (gateway/intake/memory.py) and where its limit comes
from (common/container.py): cgroup files laid out as the kernel lays them
out, v1 and v2, inside a container and on a host."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.config import ConfigError
from common.container import cgroup_memory_limit
from gateway.api.admission import ConcurrencyLimiter
from gateway.ops.workers import WorkerSlot
from gateway.routing.clients import REPLY_BYTES, ReplyQueue
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.intake.memory import (BODY_COPIES, BODY_SHARE, DECODER_PROCESS_BYTES, IDLE_DECODERS, SUPERVISOR_BYTES,
                                   MemoryBudget, MemoryHold, MemoryPlan)
from protocol.to_gateway import ChoiceDelta, TokenDelta

GIB = 2**30
MIB = 2**20
V1_UNLIMITED = "9223372036854771712"


def cgroups(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """/proc/self/cgroup with `proc`, and a /sys/fs/cgroup holding `files` (path → content)."""
    root = tmp_path / "cgroup"
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content + "\n")
    (tmp_path / "proc").write_text(proc)
    return tmp_path / "proc", root


def test_v1_the_smallest_limit_of_the_group_and_its_ancestors(tmp_path):
    proc, root = cgroups(tmp_path, "5:cpu,cpuacct:/\n4:memory:/kubepods/pod1/c1\n0::/\n", {
        "memory/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/kubepods/memory.limit_in_bytes": str(8 * GIB),
        "memory/kubepods/pod1/memory.limit_in_bytes": str(2 * GIB),
        "memory/kubepods/pod1/c1/memory.limit_in_bytes": V1_UNLIMITED,
    })
    assert cgroup_memory_limit(proc, root) == 2 * GIB


def test_v2_memory_max(tmp_path):
    proc, root = cgroups(tmp_path, "0::/system.slice/prism.service\n", {
        "cgroup.controllers": "cpu memory", "system.slice/memory.max": "max",
        "system.slice/prism.service/memory.max": str(3 * GIB)})
    assert cgroup_memory_limit(proc, root) == 3 * GIB


def test_inside_a_container_the_group_mounted_at_the_root_is_read(tmp_path):
    """No cgroup namespace: /proc/self/cgroup names the host's path, which the container does not see."""
    proc, root = cgroups(tmp_path, "9:memory:/docker/0123abcd\n", {"memory/memory.limit_in_bytes": str(2 * GIB)})
    assert cgroup_memory_limit(proc, root) == 2 * GIB


@pytest.mark.parametrize("proc,files", [
    ("4:memory:/user.slice\n", {"memory/memory.limit_in_bytes": V1_UNLIMITED}),
    ("0::/\n", {"cgroup.controllers": "cpu memory", "memory.max": "max"}),
    ("0::/\n", {}),  # hybrid: the v2 tree has no memory controller, and no v1 line names one
], ids=["v1-unlimited", "v2-max", "no-memory-controller"])
def test_no_limit_is_none(tmp_path, proc, files):
    assert cgroup_memory_limit(*cgroups(tmp_path, proc, files)) is None


def test_the_plan_leaves_requests_the_share_less_the_process(tmp_path):
    config = GatewayConfig(memory_limit_bytes="2GiB")
    plan = MemoryPlan.size(config, workers=1, rss=600 * MIB)
    decoders = IDLE_DECODERS * DECODER_PROCESS_BYTES  # the video decoders kept idle
    assert (plan.limit, plan.budget, plan.kept_heap) == (2 * GIB, int(2 * GIB * 0.8) - 600 * MIB - decoders, 256 * MIB)
    assert plan.source == "gateway.memory_limit_bytes"
    no_videos = MemoryPlan.size(GatewayConfig(memory_limit_bytes="2GiB", max_videos_per_request=0), workers=1, rss=600 * MIB)
    assert no_videos.budget == int(2 * GIB * 0.8) - 600 * MIB
    shared = MemoryPlan.size(GatewayConfig(memory_limit_bytes="4GiB", workers=2, kept_heap_bytes="64MiB"), 2, 600 * MIB)
    assert (shared.limit, shared.kept_heap) == ((4 * GIB - SUPERVISOR_BYTES) // 2, 64 * MIB) and "a share of 2 workers" in shared.source


def test_a_multi_worker_gateway_s_supervisor_stays_out_of_the_app_s_memory():
    """It supervises, and the workers share the limit less its own: the app's imports (torch, half a
    GB) would take that much again in the pod, uncounted."""
    import subprocess
    import sys

    code = "import psutil, sys, gateway.__main__; print('torch' in sys.modules, psutil.Process().memory_info().rss)"
    loaded, rss = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == "False" and int(rss) < SUPERVISOR_BYTES


def test_a_limit_the_gateway_fills_by_itself_is_refused_at_start_up():
    with pytest.raises(ConfigError, match=r"gateway.memory_use_fraction 0.8 = 819 MiB, which the gateway's own 800 MiB at "
                       r"start-up and its idle video decoders' 80 MiB fill already"):
        MemoryPlan.size(GatewayConfig(memory_limit_bytes="1GiB"), workers=1, rss=800 * MIB)


def sized(capacity: int, wait_s: float = 10) -> MemoryBudget:
    budget = MemoryBudget(wait_s)
    budget.size(capacity)
    return budget


def test_a_body_is_admitted_by_its_length_and_refused_past_the_bodies_share():
    limiter = ConcurrencyLimiter(None, None, memory=sized(100 * MIB))
    first = limiter.admit("k", 30 * MIB)  # 60 MiB counted: the body and what it becomes
    assert limiter.memory.held == BODY_COPIES * 30 * MIB
    with pytest.raises(APIError) as full:
        limiter.admit("k", 10 * MIB)  # 60 + 20 > 75: the last quarter is kept for decodes
    assert (full.value.status, full.value.headers, full.value.code) == (429, {"Retry-After": "1"}, "memory_full")
    assert limiter.in_flight == 1  # nothing of the refused one was kept
    with pytest.raises(APIError) as never:
        limiter.admit("k", 40 * MIB)  # 80 MiB: more than any one request may hold
    assert never.value.status == 413 and "admits at most 75 MiB a request" in never.value.message
    first.release()
    assert limiter.memory.in_use == 0
    limiter.admit("k", int(BODY_SHARE * 100 * MIB) // BODY_COPIES)


def test_a_decode_waits_for_room_and_gives_it_back():
    async def scenario():
        budget = sized(100 * MIB)
        body = MemoryHold(budget)
        body.admit(70 * MIB, "a body")
        decoding = MemoryHold(budget)
        started = asyncio.Event()

        async def decode():
            async with decoding.working(50 * MIB, "decoding"):
                started.set()
                assert budget.in_use == 100 * MIB  # the body's 50 left, and the decode's 50
        task = asyncio.create_task(decode())
        await asyncio.sleep(0)  # one turn of the loop: the decode runs until it blocks
        assert not started.is_set()  # 70 + 50 > 100: it waits
        body.give(20 * MIB)
        await task
        assert budget.in_use == 50 * MIB
    asyncio.run(scenario())


def test_a_decode_with_no_room_in_time_is_503_and_one_larger_than_the_budget_413():
    async def scenario():
        budget = sized(100 * MIB, wait_s=0.01)
        MemoryHold(budget).admit(70 * MIB, "a body")
        with pytest.raises(APIError) as late:
            async with MemoryHold(budget).working(50 * MIB, "decoding"):
                pass
        with pytest.raises(APIError) as huge:
            async with MemoryHold(budget).working(101 * MIB, "decoding"):
                pass
        return late.value, huge.value
    late, huge = asyncio.run(scenario())
    assert (late.status, late.headers["Retry-After"], "gateway.memory_wait_s" in late.message) == (503, "1", True)
    assert huge.status == 413 and "more than its whole budget" in huge.message


def test_a_ticket_gives_back_its_memory_once_even_what_comes_later():
    limiter = ConcurrencyLimiter(None, None, memory=sized(100 * MIB))
    ticket = limiter.admit("k", 10 * MIB)
    ticket.memory.take(5 * MIB)
    ticket.release()
    ticket.release()
    ticket.memory.take(5 * MIB)  # a reply that lands after the request ended is not counted
    assert limiter.memory.in_use == 0 and limiter.memory.held == 0


def test_replies_waiting_for_the_client_are_counted_until_taken():
    async def scenario():
        budget = sized(100 * MIB)
        hold = MemoryHold(budget)
        queue = ReplyQueue(hold)
        delta = TokenDelta("r", [ChoiceDelta(0, "x" * 1000)], 1, 1)
        for _ in range(3):
            queue.put_nowait((delta, []))
        counted = budget.in_use
        await queue.get()
        return counted, budget.in_use
    counted, after_one = asyncio.run(scenario())
    assert counted == 3 * (REPLY_BYTES + 1000) and after_one == 2 * (REPLY_BYTES + 1000)


def test_without_a_plan_nothing_is_refused():
    limiter = ConcurrencyLimiter.for_worker(None, None, None, WorkerSlot(), memory_wait_s=1)
    limiter.admit("k", 10 * GIB)


def test_an_idle_trim_sizes_the_budget_beside_what_the_process_holds_now():
    """The process has grown since start-up (here: it "started" at 1 MiB): the ceiling is kept, the budget shrinks;
    a body the planned budget could take is refused for now (429), not as too large (413)."""
    from gateway.intake.memory import HeapKeeper, process_rss

    budget = sized(4 * GIB)
    plan = MemoryPlan(limit=8 * GIB, source="", at_start=MIB, budget=4 * GIB, kept_heap=0)
    asyncio.run(HeapKeeper(plan, budget).check())
    assert 4 * GIB + MIB - process_rss() - 64 * MIB <= budget.capacity < 4 * GIB + MIB - 32 * MIB  # it holds more than that
    limiter = ConcurrencyLimiter(None, None, memory=budget)
    budget.capacity = 0
    with pytest.raises(APIError) as later:
        limiter.admit("k", MIB)
    assert later.value.status == 429


def test_a_16_bit_greyscale_conversion_stays_within_what_a_decode_is_counted():
    """The gateway admits a decode by DECODE_BYTES_PER_PIXEL: the 16-bit conversion's numpy arrays
    must leave room under it for Pillow's own images (a temporary per step once took 24 bytes a pixel)."""
    import tracemalloc

    import numpy as np
    from PIL import Image

    from gateway.intake.images import DECODE_BYTES_PER_PIXEL, _high_bit_depth_to_l

    side = 1000
    image = Image.fromarray(np.arange(side * side, dtype=np.uint16).reshape(side, side))  # mode I;16
    tracemalloc.start()
    try:
        converted = _high_bit_depth_to_l(image)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert converted.mode == "L" and converted.getpixel((999, 999)) == round(999_999 % 65536 / 257)
    assert peak / side**2 < DECODE_BYTES_PER_PIXEL - 4, f"{peak / side**2:.1f} bytes a pixel"


def test_a_reply_s_logprobs_are_counted_as_what_they_hold():
    """Twenty alternatives a token, as Python objects once received, were counted as nothing."""
    import tracemalloc

    import msgspec

    from gateway.routing.clients import reply_bytes
    from protocol.to_gateway import TokenLogprob, TopLogprob

    top = [TopLogprob(f"t{i}", -1.5, [116, 48 + i]) for i in range(20)]
    sent = msgspec.msgpack.encode(TokenDelta("r", [ChoiceDelta(0, "x", logprobs=[TokenLogprob("x", -0.1, [120], top)] * 8)], 8, 1))
    tracemalloc.start()
    received = msgspec.msgpack.decode(sent, type=TokenDelta)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert held <= reply_bytes((received, [])) < 2 * held
