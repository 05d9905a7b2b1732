"""What one crossing between two processes costs over ZMQ ipc, each leg on
its own, after the idle moment every hop of a request at concurrency 1 comes
after: with plain blocking sockets on both ends (the least any design with a
ZMQ hop between processes pays), with zmq.asyncio on both ends (as the
gateway and the engine run theirs), and, to weigh what another transport
would buy, with asyncio Unix stream sockets and no ZMQ: a crossing then wakes
one thread, the receiving one, where ZMQ also wakes an I/O thread on each side.

A DEALER sends a timestamp and one image's visual tokens (4.6 KB, the demo
model's) to a ROUTER in another process, which stamps its reply at once (the
same bytes, length-prefixed, on a stream).
`perf_counter` is one clock for every process on a host, so each leg is
timed on its own: "in" wakes the sender's ZMQ I/O thread, the receiver's and
the receiving thread after idle; "back" finds the first process just
blocked in its receive. Before the table, the floor under all of them: one
thread of another process woken through a pipe after the same idle moment.

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


FRAME = struct.Struct("I")  # a length before each message on a stream


async def read_message(reader: asyncio.StreamReader) -> bytes:
    (length,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    return await reader.readexactly(length)


def write_message(writer: asyncio.StreamWriter, message: bytes) -> None:
    writer.write(FRAME.pack(len(message)) + message)


def far_end_stream(address: str, rounds: int, legs) -> None:
    async def serve() -> None:
        done = asyncio.Event()
        got = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(rounds):
                got.append(leg_ms(await read_message(reader), time.perf_counter()))
                write_message(writer, stamped())
            done.set()

        async with await asyncio.start_unix_server(answer, address.removeprefix("ipc://")):
            await done.wait()
        legs.put(got)

    asyncio.run(serve())


async def _connect_unix(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Once the far end listens (it starts in a process of its own)."""
    for _ in range(500):
        try:
            return await asyncio.open_unix_connection(path)
        except (FileNotFoundError, ConnectionRefusedError):
            await asyncio.sleep(0.01)
    raise TimeoutError(f"nothing listens on {path}")


def near_end_stream(address: str, rounds: int, idle_s: float) -> list[float]:
    async def ask() -> list[float]:
        reader, writer = await _connect_unix(address.removeprefix("ipc://"))
        back = []
        for _ in range(rounds):
            await asyncio.sleep(idle_s)
            write_message(writer, stamped(PAYLOAD))
            back.append(leg_ms(await read_message(reader), time.perf_counter()))
        writer.close()
        return back

    return asyncio.run(ask())


ENDS = {
    "blocking sockets": (far_end_sync, near_end_sync),
    "zmq.asyncio": (far_end_async, near_end_async),
    "asyncio Unix stream, no ZMQ": (far_end_stream, near_end_stream),
}


def thread_wake_ms(rounds: int, idle_s: float) -> float:
    """Median ms from a write into a pipe to the other process's blocked read
    returning, after `idle_s`: one thread woken, no Python work but the read."""
    spawn = multiprocessing.get_context("spawn")
    reader, writer = spawn.Pipe(duplex=False)
    answer_reader, answer_writer = spawn.Pipe(duplex=False)
    process = spawn.Process(target=_pipe_reader, args=(reader, answer_writer, rounds))
    process.start()
    for _ in range(rounds):
        time.sleep(idle_s)
        writer.send_bytes(stamped())
    median = answer_reader.recv()
    process.join()
    return median


def _pipe_reader(reader, answer, rounds: int) -> None:
    got = [leg_ms(reader.recv_bytes(), time.perf_counter()) for _ in range(rounds)]
    answer.send(statistics.median(got[1:]))


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
    print(f"A thread of another process woken through a pipe: {thread_wake_ms(args.rounds, args.idle_ms / 1e3):.3f} ms\n")
    print("| ends | leg in | leg back | round trip |\n|---|---|---|---|")
    for _ in range(args.repeats):
        for ends in ENDS:
            into, back = measure(ends, args.rounds, args.idle_ms / 1e3)
            print(f"| {ends} | {into:.3f} ms | {back:.3f} ms | {into + back:.3f} ms |", flush=True)


if __name__ == "__main__":
    main()
