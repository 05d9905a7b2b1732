"""What the encoder and engine pools share: a set of replicas of one service,
their health, the choice of the least loaded, and a memory of which replica
last served each image (its caches hold that image's work)."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import socket
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

import zmq.asyncio

from gateway.clients import ServiceClient
from gateway.errors import APIError

RETRIABLE = (503, 429)  # the replica is gone, draining or full; another may not be
LAST_SERVED_ENTRIES = 65536  # digests remembered for affinity (~3 MB)

C = TypeVar("C", bound=ServiceClient)
log = logging.getLogger("prism.gateway")


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


class ReplicaPool(Generic[C]):
    kind = "service"  # named in errors and logs: "vision encoder", "LLM engine"
    client: type[C]  # the client class of one replica
    same: str  # the handshake field every replica must agree on

    def __init__(self, ctx: zmq.asyncio.Context, addresses: Sequence[str], heartbeat_timeout_s: float) -> None:
        if not addresses:
            raise ValueError(f"at least one {self.kind} address is needed")
        names = [f"{self.kind} {i}" if len(addresses) > 1 else self.kind for i in range(len(addresses))]
        self.replicas: list[C] = [self.client(ctx, a, n, heartbeat_timeout_s) for a, n in zip(addresses, names)]
        self.requests_sent = [0] * len(self.replicas)
        self.failovers = 0  # requests moved to another replica after a refusal
        self._last_served: OrderedDict[bytes, int] = OrderedDict()  # digest → replica (LRU)
        self._rotation = itertools.count()

    async def connect(self, timeout_s: float):
        """Handshake with every replica; they must agree on `same`. The first one's answer."""
        infos = await asyncio.gather(*(replica.connect(timeout_s) for replica in self.replicas))
        if len({getattr(info, self.same) for info in infos}) > 1:
            raise RuntimeError(f"{self.kind} replicas differ in {self.same}: " + ", ".join(
                f"{r.address} ({i.model})" for r, i in zip(self.replicas, infos)))
        return infos[0]

    def start_heartbeat(self, interval_s: float) -> None:
        for replica in self.replicas:
            replica.start_heartbeat(interval_s)

    async def close(self) -> None:
        for replica in self.replicas:
            await replica.close()

    @property
    def up(self) -> bool:
        return any(replica.up for replica in self.replicas)

    def unavailable(self):
        return self.replicas[0].unavailable(f"{self.kind} is unavailable; retry shortly")

    def require_up(self) -> None:
        if not self.up:
            raise self.unavailable()

    def candidates(self, exclude: set[int]) -> list[int]:
        return [i for i, replica in enumerate(self.replicas) if replica.up and i not in exclude]

    def pick(self, digests: Iterable[bytes], exclude: set[int]) -> int | None:
        """The up replica, not in `exclude`, that last served one of these images,
        else the least loaded; None when there is none."""
        candidates = self.candidates(exclude)
        if not candidates:
            return None
        served = self.last_served(digests, candidates)
        return served if served is not None else self.least_outstanding(candidates)

    def note_failover(self, refused: APIError, index: int) -> None:
        self.failovers += 1
        log.warning("%s; trying %s", refused.message, self.replicas[index].name)

    def last_served(self, digests: Iterable[bytes], candidates: list[int]) -> int | None:
        """The candidate that last served one of these images, if any."""
        for digest in digests:
            if (i := self._last_served.get(digest)) in candidates:
                return i
        return None

    def least_outstanding(self, candidates: list[int]) -> int:
        turn = next(self._rotation)  # ties rotate
        return min(candidates, key=lambda i: (self.replicas[i].outstanding, (i - turn) % len(self.replicas)))

    def remember(self, digests: Iterable[bytes], index: int) -> None:
        for digest in digests:
            self._last_served[digest] = index
            self._last_served.move_to_end(digest)
        while len(self._last_served) > LAST_SERVED_ENTRIES:
            self._last_served.popitem(last=False)
