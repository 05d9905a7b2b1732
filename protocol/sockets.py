"""Typed ZMQ sockets: a call site reads `await engine.send(msg, frames)`.

A multipart message is [header, *frames]: the header is the msgpack-encoded
message (its class name is the tag) and each frame is one raw array buffer,
sent and received without copies. ROUTER sockets prefix the peer identity.

A message this side cannot read (garbage, a truncated message, a peer of
another wire version: protocol/base.py) is logged and skipped by `recv`: one bad message never ends a
service's loop or a reader task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket as stdlib_socket
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from protocol.base import PROTOCOL, Message

In = TypeVar("In")
log = logging.getLogger("prism.protocol")

_encoder = msgspec.msgpack.Encoder()


def pack(message: Message, frames: Sequence[Any] = ()) -> list[Any]:
    return [_encoder.encode(message), *frames]


def size_of(parts: Sequence[Any]) -> int:
    """Bytes in a multipart message: header and frames (bytes, arrays, buffers or zmq.Frames)."""
    return sum(len(part) if isinstance(part, zmq.Frame) else memoryview(part).nbytes for part in parts)


def bind(socket: zmq.Socket, address: str) -> None:
    """Bind, creating the directory of an ipc:// path first. ZMQ replaces an ipc:// path's
    file silently: a process still serving there (an orphan of an earlier stack, finishing
    its start) would lose its socket to this one, or take it back, so that is refused."""
    if address.startswith("ipc://"):
        path = Path(address.removeprefix("ipc://"))
        path.parent.mkdir(parents=True, exist_ok=True)
        if _answers(path):
            raise zmq.ZMQError(zmq.EADDRINUSE, f"{address}: another process is bound there and serving")
    socket.bind(address)


def _answers(path: Path) -> bool:
    """Whether a process holds the unix socket at `path`: it accepts a connection, or its
    queue is full (a file left by one that died refuses connections)."""
    if not path.is_socket():
        return False
    with contextlib.closing(stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (TimeoutError, BlockingIOError):  # alive, not accepting (stopped, or behind)
            return True
        except OSError:
            return False
    return True


# Unreadable messages logged one by one; past this, one line per LOG_EVERY (a flood must not fill the disk).
LOG_FIRST, LOG_EVERY = 10, 1000
MAX_VERSION_DIGITS = 9  # a longer "/v…" is no version of this project's


def _other_version(parts: list[zmq.Frame]) -> int | None:
    """The wire version an unreadable message's tag names, where it is not this side's: 0 for a
    message of a release from before versions were said (its tag a bare class name)."""
    try:
        tag = msgspec.msgpack.decode(parts[0].buffer)[0]
    except Exception:  # no tag to read
        return None
    if not isinstance(tag, str) or tag in ("Hello", "WrongProtocol") or tag.endswith(f"/v{PROTOCOL}"):
        return None
    name, _, version = tag.rpartition("/v")
    if not name:
        return 0 if tag.isidentifier() else None
    # "²" is a digit int() refuses, and int() refuses past 4,300 digits: a peer's tag must not raise here
    return int(version) if version.isascii() and version.isdigit() and len(version) <= MAX_VERSION_DIGITS else None


class _Typed(Generic[In]):
    def __init__(self, socket: zmq.Socket, inbound: Any) -> None:
        self.socket = socket
        self._decoder = msgspec.msgpack.Decoder(inbound)
        self.unreadable = 0  # messages skipped so far
        self.other_version: int | None = None  # the wire version its peer was last heard in, where not this side's

    def _read(self, parts: list[zmq.Frame], peer: bytes | None = None) -> tuple[In, list[memoryview]] | None:
        """The message and its frames; None for one this side cannot read (logged and counted)."""
        try:
            header, *frames = parts
            return self._decoder.decode(header.buffer), [f.buffer for f in frames]
        except (ValueError, msgspec.DecodeError) as exc:  # no header; not msgpack, or not a message of this side's
            self.unreadable += 1
            if (version := _other_version(parts)) is not None:
                self.other_version = version
            if self.unreadable <= LOG_FIRST or self.unreadable % LOG_EVERY == 0:
                sender = f" from peer {peer.hex()}" if peer is not None else ""
                hint = "" if version is None else f" (its sender speaks wire protocol v{version}, this side v{PROTOCOL})"
                log.warning("skipped a message%s this side cannot read (%d so far): %s%s", sender, self.unreadable, exc, hint)
            return None

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long messages already sent may still leave (0: dropped)."""
        self.socket.close(linger=linger_ms)


class AsyncDealer(_Typed[In]):
    """One side of a request/reply stream to a ROUTER (gateway → service).
    `count(direction, nbytes)`, if given, hears of every message's size
    ("sent" or "received"). Never ZMQ_IMMEDIATE: with it, zmq drops the replies
    still unread when the connection drops, and a service that answers and then
    closes (an engine at the end of its drain) sends its last ones just before."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, inbound: Any,
                 count: Callable[[str, int], None] | None = None) -> None:
        socket = ctx.socket(zmq.DEALER)
        socket.connect(address)
        super().__init__(socket, inbound)
        self._count = count

    async def send(self, message: Message, frames: Sequence[Any] = ()) -> None:
        parts = pack(message, frames)
        await self.socket.send_multipart(parts, copy=False)
        if self._count:
            self._count("sent", size_of(parts))

    async def recv(self) -> tuple[In, list[memoryview]]:
        """The next message this side can read."""
        while True:
            parts = await self.socket.recv_multipart(copy=False)
            if self._count:
                self._count("received", size_of(parts))
            if (read := self._read(parts)) is not None:
                return read


# How long a waiting send waits for a peer whose queue is full before giving up (zmq.Again).
FULL_PEER_WAIT_S = 10.0
_RETRY_PAUSE_S = (0.001, 0.05)  # the first and the longest pause between tries on a full peer


class AsyncRouter(_Typed[In]):
    """The service side: many peers (gateways, encoders pushing) may connect."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, inbound: Any, full_peer_wait_s: float = FULL_PEER_WAIT_S,
                 receive_limit: int | None = None) -> None:
        """`receive_limit`: messages queued per peer for this side to read (zmq's RCVHWM; its
        default, 1,000, is a gigabyte of a 7B model's visual tokens pushed while the loop is busy)."""
        socket = ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if receive_limit is not None:
            socket.setsockopt(zmq.RCVHWM, receive_limit)
        bind(socket, address)
        super().__init__(socket, inbound)
        self._now = zmq.Socket.shadow(socket.underlying)  # the same socket, sent on synchronously
        self.full_peer_wait_s = full_peer_wait_s

    async def send(self, peer: bytes, message: Message, frames: Sequence[Any] = (), wait: bool = True,
                   wait_s: float | None = None) -> None:
        """`wait` False: sent now or never (zmq.Again while the peer's queue is
        full), so a loop that serves every peer never waits behind one: pyzmq's
        asyncio socket queues a send behind any still pending, NOBLOCK or not,
        so this one goes through the socket itself. `wait` True: in turn after
        those, waiting up to `wait_s` (`full_peer_wait_s` when None) for a peer
        whose queue is full (a gateway that stalled a moment), then zmq.Again. A peer that is gone
        fails it at once (ROUTER_MANDATORY: zmq.ZMQError)."""
        parts = [peer, *pack(message, frames)]
        if not wait:
            self._now.send_multipart(parts, zmq.NOBLOCK, copy=False)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.full_peer_wait_s if wait_s is None else wait_s)
        pause, longest = _RETRY_PAUSE_S
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    await self.socket.send_multipart(parts, copy=False)
                return
            except TimeoutError:  # the socket had no room for any peer all along
                raise zmq.Again() from None
            except zmq.Again:
                # Only this peer is full: the socket is writable for others (another gateway, an
                # encoder's pusher), so pyzmq raised at once instead of waiting. Try again shortly.
                if loop.time() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, longest)

    async def recv(self) -> tuple[bytes, In, list[memoryview]]:
        """The next message this side can read, and its sender."""
        while True:
            peer, *parts = await self.socket.recv_multipart(copy=False)
            if (read := self._read(parts, peer.bytes)) is not None:
                return peer.bytes, *read


class Publisher:
    """Headers only, to every subscriber connected. A PUB socket never blocks
    (a slow subscriber loses messages past its high-water mark), so `send` is
    a plain call, safe on an event loop."""

    def __init__(self, ctx: zmq.Context | zmq.asyncio.Context, address: str) -> None:
        self.socket = zmq.Context.shadow(ctx.underlying).socket(zmq.PUB)
        bind(self.socket, address)

    def send(self, message: Message) -> None:
        self.socket.send(_encoder.encode(message))

    def close(self) -> None:
        self.socket.close(linger=0)


class AsyncSubscriber(_Typed[In]):
    """Everything the publishers at `addresses` send (they may come and go)."""

    def __init__(self, ctx: zmq.asyncio.Context, addresses: Sequence[str], inbound: Any) -> None:
        socket = ctx.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        for address in addresses:
            socket.connect(address)
        super().__init__(socket, inbound)

    async def recv(self) -> In:
        """The next message this side can read."""
        while True:
            if (read := self._read([await self.socket.recv(copy=False)])) is not None:
                return read[0]


class Pusher:
    """Unasked messages to services' ROUTERs (an encoder's visual tokens to the
    engine that will need them), from a blocking loop that must not wait: one
    DEALER per address, made at first use. A message is queued only on a
    connection that is up (IMMEDIATE) and below `queue_limit` messages, else
    it is not sent (`send` says False) and the receiver asks for it instead."""

    def __init__(self, ctx: zmq.Context, queue_limit: int, addresses_kept: int = 64) -> None:
        self.ctx = ctx
        self.queue_limit = queue_limit
        # Engines come and go (a replaced pod has a new address): past this many, the least
        # recently used socket is closed, or it would retry a dead address for good.
        self.addresses_kept = addresses_kept
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()

    @property
    def addresses(self) -> list[str]:
        """The addresses it holds a socket to, least recently used first."""
        return list(self._sockets)

    def send(self, address: str, message: Message, frames: Sequence[Any] = ()) -> bool:
        if address not in self._sockets:
            socket = self.ctx.socket(zmq.DEALER)
            socket.setsockopt(zmq.IMMEDIATE, 1)
            socket.setsockopt(zmq.SNDHWM, self.queue_limit)
            socket.setsockopt(zmq.LINGER, 0)  # best effort: an exiting encoder never waits on a push
            try:
                socket.connect(address)
            except zmq.ZMQError:  # an address zmq cannot take: nothing is pushed, the receiver asks instead
                socket.close()
                return False
            self._sockets[address] = socket
            while len(self._sockets) > self.addresses_kept:
                self._sockets.popitem(last=False)[1].close()
        self._sockets.move_to_end(address)
        try:
            self._sockets[address].send_multipart(pack(message, frames), zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:  # not connected (yet), or its queue is full
            return False

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close()
        self._sockets.clear()


class SyncRouter(_Typed[In]):
    """A ROUTER for a blocking run loop (the encoder's)."""

    def __init__(self, ctx: zmq.Context, address: str, inbound: Any) -> None:
        socket = ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bind(socket, address)
        super().__init__(socket, inbound)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def send(self, peer: bytes, message: Message, frames: Sequence[Any] = ()) -> None:
        """Never waits: a peer that stops reading (its queue at the high-water
        mark) must not stop the loop for every other peer. zmq.Again then, like
        any ZMQError for a peer that is gone: the reply is lost to it alone."""
        self.socket.send_multipart([peer, *pack(message, frames)], zmq.NOBLOCK, copy=False)

    def recv(self) -> tuple[bytes, In, list[memoryview]] | None:
        """The next message, after `poll` said one is there; None when it could
        not be read (logged and skipped)."""
        peer, *parts = self.socket.recv_multipart(copy=False)
        read = self._read(parts, peer.bytes)
        return None if read is None else (peer.bytes, *read)
