"""Several vision-encoder replicas behind one gateway.

A request keeps one replica over its rounds (lookup by digest, then pixels
for the misses). It goes to the replica already serving one of its images, so
concurrent requests for a new image cost one encode across replicas, not one
per replica; else to the replica that last served one of its images (its
local cache has them: no Redis round trip, no race with the shared write);
else to the up replica with the fewest requests outstanding (ties rotate). Replicas share visual tokens through the Redis tier when one is
configured, so where an image was encoded before does not matter.

A replica that stops answering is marked down by its heartbeat, which fails
its in-flight requests with 503; the pool sends each of them to another
replica, so a replica's death costs time, not requests. A 429 (that replica's
queue is full) also moves on; the caller sees an error only when every
replica has refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from gateway.clients import EncoderClient
from gateway.errors import APIError
from protocol.to_encoder import ImageInput
from protocol.to_gateway import EncodeNeedsPixels, EncodeResult

log = logging.getLogger("prism.gateway")
RETRIABLE = (503, 429)  # the replica is gone or full; another may not be
LAST_SERVED_ENTRIES = 65536  # digests remembered for affinity (~3 MB)


def expand_addresses(addresses: Sequence[str]) -> list[str]:
    """One address per replica: a tcp:// host name that resolves to several
    addresses (docker compose's DNS for a service run with --scale) becomes one
    replica per address. Resolved once, at start-up; ipc:// and literal IPs stay."""
    expanded: list[str] = []
    for address in addresses:
        scheme, _, rest = address.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme != "tcp" or not port.isdigit() or _is_ip(host.strip("[]")):
            expanded.append(address)
            continue
        ips = sorted({info[4][0] for info in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)})
        expanded += [f"tcp://{f'[{ip}]' if ':' in ip else ip}:{port}" for ip in ips]
    return list(dict.fromkeys(expanded))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@dataclass
class Route:
    """One request's way through the pool: its images and the replica serving it."""

    digests: tuple[bytes, ...]
    replica: int | None = None
    tried: set[int] = field(default_factory=set)  # replicas that refused it


class EncoderPool:
    def __init__(self, ctx: zmq.asyncio.Context, addresses: Sequence[str], heartbeat_timeout_s: float) -> None:
        if not addresses:
            raise ValueError("at least one encoder address is needed")
        many = len(addresses) > 1
        self.replicas = [
            EncoderClient(ctx, address, f"vision encoder {i}" if many else "vision encoder", heartbeat_timeout_s)
            for i, address in enumerate(addresses)
        ]
        self._encoding: list[Counter[bytes]] = [Counter() for _ in self.replicas]  # digests in flight per replica
        self._last_served: OrderedDict[bytes, int] = OrderedDict()  # digest → replica that last had it (LRU)
        self._rotation = itertools.count()
        self.requests_sent = [0] * len(self.replicas)
        self.failovers = 0

    async def connect(self, timeout_s: float):
        """Handshake with every replica; they must serve the same checkpoint."""
        infos = await asyncio.gather(*(replica.connect(timeout_s) for replica in self.replicas))
        fingerprints = {info.fingerprint for info in infos}
        if len(fingerprints) > 1:
            addresses = ", ".join(f"{r.address} ({i.model})" for r, i in zip(self.replicas, infos))
            raise RuntimeError(f"encoder replicas serve different checkpoints or preprocessing: {addresses}")
        return infos[0]

    def start_heartbeat(self, interval_s: float) -> None:
        for replica in self.replicas:
            replica.start_heartbeat(interval_s)

    @property
    def up(self) -> bool:
        return any(replica.up for replica in self.replicas)

    def require_up(self) -> None:
        if not self.up:
            raise self.replicas[0].unavailable("vision encoder is unavailable; retry shortly")

    @contextlib.contextmanager
    def route(self, digests: Sequence[bytes]) -> Iterator[Route]:
        """Hold one request's replica over all its rounds (lookup, then pixels)."""
        route = Route(tuple(digests))
        try:
            yield route
        finally:
            self._leave(route)

    def _pick(self, route: Route) -> int | None:
        candidates = [i for i, replica in enumerate(self.replicas) if replica.up and i not in route.tried]
        if not candidates:
            return None
        for i in candidates:  # one already encoding an image of ours: join it there
            if any(self._encoding[i][digest] for digest in route.digests):
                return i
        for digest in route.digests:  # one that encoded an image of ours: a local hit there
            if (i := self._last_served.get(digest)) in candidates:
                return i
        turn = next(self._rotation)
        return min(candidates, key=lambda i: (self.replicas[i].outstanding, (i - turn) % len(self.replicas)))

    def _enter(self, route: Route) -> bool:
        route.replica = self._pick(route)
        if route.replica is None:
            return False
        self._encoding[route.replica].update(route.digests)
        return True

    def _leave(self, route: Route) -> None:
        if route.replica is not None:
            for digest in route.digests:
                self._last_served[digest] = route.replica
                self._last_served.move_to_end(digest)
            while len(self._last_served) > LAST_SERVED_ENTRIES:
                self._last_served.popitem(last=False)
            self._encoding[route.replica].subtract(route.digests)
            self._encoding[route.replica] += Counter()  # drop zero counts
            route.replica = None

    async def encode(
        self, route: Route, request_id: str, images: Sequence[ImageInput], frames: Sequence[Any], timeout_s: float,
        retry: bool = False,
    ) -> tuple[EncodeResult | EncodeNeedsPixels, list[memoryview]]:
        """One round on the route's replica; on a 503 or 429, the same round on another."""
        refused: APIError | None = None
        while True:
            if route.replica is None and not self._enter(route):
                raise refused or self.replicas[0].unavailable("vision encoder is unavailable; retry shortly")
            if refused is not None:
                self.failovers += 1
                log.warning("%s; trying %s", refused.message, self.replicas[route.replica].name)
            replica = self.replicas[route.replica]
            self.requests_sent[route.replica] += 1
            try:
                return await replica.encode(request_id, images, frames, timeout_s, retry)
            except APIError as error:
                if error.status not in RETRIABLE:
                    raise
                refused = error
                route.tried.add(route.replica)
                self._leave(route)

    async def close(self) -> None:
        for replica in self.replicas:
            await replica.close()
