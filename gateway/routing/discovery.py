"""Replicas found by DNS, kept current while the gateway runs.

A `tcp://` address whose host is a name stands for every address that name
resolves to: docker compose's DNS for a scaled service, or a Kubernetes
headless Service, which has one A record per ready pod. Every
`gateway.discovery_interval_s` the gateway resolves its names again and hands
the answer to an `update` callback, the pool's (`ReplicaPool.update`; this
module knows no pool, so the two do not import each other): an address that
appeared joins once its handshake answers; one that is gone takes no new
requests, and its requests in flight finish (or fail, as they would have)
before it is closed.

Only an answer changes the set. A lookup that fails (DNS unreachable, or a
name with no records while its pods restart) leaves the replicas as they are:
a DNS hiccup must not empty a pool whose replicas still serve.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence

log = logging.getLogger("prism.gateway")

Lookup = Callable[[str, int], Iterable[str]]  # (host, port) → IP addresses; OSError when there are none
Update = Callable[[list[str], float], Awaitable[None]]  # (every replica's address, join timeout): the pool's `update`


def dns_lookup(host: str, port: int) -> list[str]:
    """The system resolver (a blocking call: run it in a thread). IPv4 where the name has it: the
    services listen on tcp://0.0.0.0, so a dual-stack name's IPv6 addresses would never answer."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
    return v4 or [info[4][0] for info in infos]


def host_and_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a `tcp://name:port` address; None for ipc://, literal IPs and the like."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit() or not host or _is_ip(host.strip("[]")):
        return None
    return host, int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def follows_dns(addresses: Sequence[str]) -> bool:
    return any(host_and_port(address) for address in addresses)


def replica_addresses(address: str, lookup: Lookup = dns_lookup) -> list[str]:
    """One address per replica: `tcp://name:port` becomes `tcp://ip:port` for
    each address the name resolves to (raising OSError when it resolves to
    none); any other address stands for itself."""
    if (named := host_and_port(address)) is None:
        return [address]
    host, port = named
    ips = sorted(set(lookup(host, port)))
    if not ips:
        raise socket.gaierror(f"{host} resolved to no address")
    return [f"tcp://{f'[{ip}]' if ':' in ip else ip}:{port}" for ip in ips]


def resolve_all(addresses: Sequence[str], lookup: Lookup = dns_lookup) -> list[str]:
    """Every replica the configured addresses stand for, in order, once each."""
    return list(dict.fromkeys(a for address in addresses for a in replica_addresses(address, lookup)))


class Discovery:
    """Re-resolves one pool's configured addresses and hands the answer to `update`.
    `kind` names the pool in the log ("vision encoder", "LLM engine")."""

    def __init__(self, addresses: Sequence[str], join_timeout_s: float, update: Update, kind: str,
                 lookup: Lookup | None = None) -> None:
        self.update = update
        self.kind = kind
        self.addresses = tuple(addresses)
        self.join_timeout_s = join_timeout_s
        self.lookup = lookup or dns_lookup
        self._failing = False  # log a failing lookup once, not every interval

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            wanted = await asyncio.to_thread(resolve_all, self.addresses, self.lookup)
        except OSError as exc:
            if not self._failing:
                log.warning("%s discovery: %s did not resolve (%s); the replicas stay as they are",
                            self.kind, ", ".join(self.addresses), exc)
            self._failing = True
            return
        self._failing = False
        await self.update(wanted, self.join_timeout_s)
