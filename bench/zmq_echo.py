"""The far end of a ZMQ round-trip floor: a ROUTER that answers `rounds`
messages with no Python work between, on a thread of the measuring process
or, run as `python -m bench.zmq_echo ADDRESS ROUNDS echo|ok`, in a process of
its own (as each service is: bench.floor's crossing floor)."""

from __future__ import annotations

import sys

import zmq


def answer(router: zmq.Socket, rounds: int, echo: bool) -> None:
    """The message itself back (`echo`), or a two-byte reply."""
    for _ in range(rounds):
        parts = router.recv_multipart(copy=False)
        router.send_multipart(parts if echo else [parts[0], b"ok"], copy=False)


def main(address: str, rounds: int, reply: str) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    answer(router, rounds, reply == "echo")
    router.close(linger=1000)  # the last answer still leaves
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
