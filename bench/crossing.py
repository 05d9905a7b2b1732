"""What one crossing between two processes costs over ZMQ ipc, each leg on
its own, after the idle moment every hop of a request at concurrency 1 comes
after: with plain blocking sockets on both ends (the least any design with a
ZMQ hop between processes pays), and with zmq.asyncio on both ends (as the
gateway, the encoder's I/O and the engine run theirs).

A DEALER sends a timestamp and one image's visual tokens (4.6 KB, the demo
model's) to a ROUTER in another process, which stamps its reply at once.
`perf_counter` is one clock for every process on a host, so each leg is
timed on its own: "in" wakes the sender's ZMQ I/O thread, the receiver's and
the receiving thread after idle; "back" finds the first process just
blocked in its receive.

Run: .venv/bin/python -m bench.crossing [--rounds 150] [--idle-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import struct
import tempfile
import time

import zmq
import zmq.asyncio

PAYLOAD = b"p" * 4608
STAMP = struct.Struct("d")


def stamped(body: bytes = b"") -> bytes:
    return STAMP.pack(time.perf_counter()) + body


def leg_ms(message: bytes, arrived: float) -> float:
    return (arrived - STAMP.unpack_from(message)[0]) * 1e3


def far_end_sync(address: str, rounds: int, legs) -> None:
    router = zmq.Context().socket(zmq.ROUTER)
    router.bind(address)
    got = []
    for _ in range(rounds):
        peer, message = router.recv_multipart()
        got.append(leg_ms(message, time.perf_counter()))
        router.send_multipart([peer, stamped()])
    legs.put(got)


def far_end_async(address: str, rounds: int, legs) -> None:
    async def serve() -> None:
        router = zmq.asyncio.Context().socket(zmq.ROUTER)
        router.bind(address)
        got = []
        for _ in range(rounds):
            peer, message = await router.recv_multipart()
            got.append(leg_ms(message, time.perf_counter()))
            await router.send_multipart([peer, stamped()])
        legs.put(got)

    asyncio.run(serve())


def near_end_sync(address: str, rounds: int, idle_s: float) -> list[float]:
    ctx = zmq.Context()  # this process measures every pair: its I/O threads must not pile up
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    back = []
    for _ in range(rounds):
        time.sleep(idle_s)
        dealer.send(stamped(PAYLOAD))
        back.append(leg_ms(dealer.recv(), time.perf_counter()))
    ctx.destroy(linger=0)
    return back


def near_end_async(address: str, rounds: int, idle_s: float) -> list[float]:
    async def ask() -> list[float]:
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(address)
        back = []
        for _ in range(rounds):
            await asyncio.sleep(idle_s)
            await dealer.send(stamped(PAYLOAD))
            back.append(leg_ms(await dealer.recv(), time.perf_counter()))
        ctx.destroy(linger=0)
        return back

    return asyncio.run(ask())


ENDS = {"blocking sockets": (far_end_sync, near_end_sync), "zmq.asyncio": (far_end_async, near_end_async)}


def measure(ends: str, rounds: int, idle_s: float) -> tuple[float, float]:
    """Median ms of the leg in and the leg back, the first (connecting) round left out."""
    far_end, near_end = ENDS[ends]
    spawn = multiprocessing.get_context("spawn")
    legs = spawn.Queue()
    with tempfile.TemporaryDirectory() as directory:
        address = f"ipc://{directory}/crossing.sock"
        process = spawn.Process(target=far_end, args=(address, rounds + 1, legs))
        process.start()
        back = near_end(address, rounds + 1, idle_s)
        into = legs.get(timeout=60)
        process.join()
    return statistics.median(into[1:]), statistics.median(back[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--idle-ms", type=float, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="each kind of end this many times, alternated")
    args = parser.parse_args()
    print("| ends | leg in | leg back | round trip |\n|---|---|---|---|")
    for _ in range(args.repeats):
        for ends in ENDS:
            into, back = measure(ends, args.rounds, args.idle_ms / 1e3)
            print(f"| {ends} | {into:.3f} ms | {back:.3f} ms | {into + back:.3f} ms |", flush=True)


if __name__ == "__main__":
    main()
