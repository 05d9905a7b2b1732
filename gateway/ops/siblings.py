"""A gateway worker's line to the other workers of the same gateway
(`gateway.workers` > 1), over ipc:// PUB/SUB sockets in the gateway's run
directory: every finished request goes into every worker's dashboard window,
and each worker says how many requests it has in flight. So /dashboard
answers for the whole gateway whichever worker the connection reached.

Nothing here decides admission or routing: those need no shared state
(gateway/api/admission.py, gateway/routing/replicas.py). A worker that restarts starts
with an empty window of its own; the others keep what it had sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import zmq.asyncio

from gateway.ops.workers import WorkerSlot, worker_address
from gateway.ops.dashboard import DashboardWindow
from protocol.siblings import FinishedRequest, SiblingInbound, WorkerLoad
from protocol.sockets import AsyncSubscriber, Publisher


class Siblings:
    def __init__(self, ctx: zmq.asyncio.Context, run_dir: Path, slot: WorkerSlot, window: DashboardWindow) -> None:
        self.slot = slot
        self.window = window
        self.loads: dict[int, int] = {}  # worker → its requests in flight, as it last said
        self._out = Publisher(ctx, worker_address(run_dir, slot.index))
        others = [worker_address(run_dir, i) for i in range(slot.count) if i != slot.index]
        self._in = AsyncSubscriber(ctx, others, SiblingInbound)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            message = await self._in.recv()  # one it cannot read (a sibling of another version) is skipped
            if isinstance(message, FinishedRequest):
                self.window.add(message)
            else:
                self.loads[message.worker] = message.in_flight

    def finished(self, record: FinishedRequest) -> None:
        self._out.send(record)

    def load(self, in_flight: int) -> None:
        self._out.send(WorkerLoad(self.slot.index, in_flight))

    @property
    def in_flight_elsewhere(self) -> int:
        return sum(self.loads.values())

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._out.close()
        self._in.close()
