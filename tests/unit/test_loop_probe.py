"""The loop probe sees a callback that holds the event loop, and a free loop as free."""

import asyncio
import time

from gateway.ops.loop_probe import LoopProbe


async def _probed(hold_s: float) -> list[float]:
    seen: list[float] = []
    probe = LoopProbe(asyncio.get_running_loop(), seen.append, interval_s=0.01)
    probe.start()
    await asyncio.sleep(0.1)  # a free loop, probed meanwhile: the behaviour measured, not a wait for a state
    time.sleep(hold_s)  # one callback holding the loop, as a long parse would
    await asyncio.sleep(0.1)  # free again: the probe sees the hold end
    probe.stop()
    return seen


def test_a_held_loop_is_seen():
    hold_s = 0.2
    seen = asyncio.run(_probed(hold_s))
    assert max(seen) >= 0.15  # the probe posted during the hold waited it out
    # The rest of the time the loop was free: most probes saw less than the hold (no absolute lag: loaded cores).
    assert sorted(seen)[len(seen) // 2] < max(seen) / 2


def test_one_probe_at_a_time():
    seen = asyncio.run(_probed(0.3))
    assert len(seen) < 30  # about 20; a post every 10 ms, held ones included, would be 50
