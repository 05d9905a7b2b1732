"""Fetching http(s) image and video URLs without becoming a proxy into private
networks. Errors name what was fetched: `image_fetch_failed` for an image,
`video_fetch_failed` for a video (the byte limits' `noun`).

Every hop (the URL and each redirect) is parsed, its host resolved, and every
resolved address checked: loopback, private, link-local, multicast, reserved,
unspecified and other non-global addresses are refused unless their network
is explicitly allowed. Checking the resolved address covers every spelling of
a host (decimal `2130706433`, octal `0177.0.0.1`, IPv4-mapped IPv6
`[::ffff:127.0.0.1]`). The connection then goes to the address that was
checked (the URL is rewritten to it, with the Host header and TLS SNI set to
the original name), so DNS cannot change between check and fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx
import idna

from gateway.errors import APIError
from gateway.intake.images import ImageLimits
from gateway.intake.memory import BODY_COPIES, hold, working

log = logging.getLogger("prism.gateway")

_REDIRECTS = {301, 302, 303, 307, 308}
_DEFAULT_PORTS = {"http": 80, "https": 443}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Image hosts are resolved on threads of their own. A user's URL may name a host
# whose name servers never answer: getaddrinfo then blocks its thread for the
# resolver's own timeouts, past the fetch's deadline, and on the loop's default
# executor a few of those would hold up the gateway's other work (service
# discovery, the heap trim). Threads blocked on DNS cost no CPU: a bigger pool
# only bounds how many lookups wait at once.
DNS_THREADS = 32
_resolver = ThreadPoolExecutor(DNS_THREADS, thread_name_prefix="prism-dns")


@dataclass(frozen=True)
class FetchLimits:
    connect_timeout_s: float
    read_timeout_s: float
    total_timeout_s: float
    max_redirects: int
    allowed_domains: tuple[str, ...] = ()  # empty: any host (that resolves to a public address)
    allowed_networks: tuple[str, ...] = ()  # explicit opt-in for private/loopback networks


@dataclass(frozen=True)
class Target:
    url: str  # rewritten to the checked address
    host_header: str
    sni_hostname: str | None


def refusal_reason(address: IPAddress) -> str | None:
    """Why an address may not be fetched from by default, or None if it is public."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return refusal_reason(address.ipv4_mapped)
    # a 6to4 address (2002::/16) is public, yet a 6to4 relay delivers it to the IPv4
    # address inside it: refuse it where that one would be refused
    if isinstance(address, ipaddress.IPv6Address) and address.sixtofour is not None:
        inner = refusal_reason(address.sixtofour)
        if inner is not None:
            return f"6to4-{inner}"
    # is_site_local: IPv6's deprecated fec0::/10, still routed on some networks, which
    # Python 3.11 counts as global
    for attribute in ("is_unspecified", "is_loopback", "is_link_local", "is_site_local", "is_multicast", "is_private", "is_reserved"):
        if getattr(address, attribute, False):
            return attribute.removeprefix("is_").replace("_", "-")
    if not address.is_global:
        return "non-global"
    return None


def _lookup(host: str, port: int) -> list:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _split(url: str, where: str, kind: str):
    try:
        return urlsplit(url)
    except ValueError as exc:  # a malformed IPv6 literal ("http://[::1/x")
        raise APIError(400, f"{where}: invalid URL ({exc})", param=where, code=f"invalid_{kind}_url") from None


# A host as the resolver reads it: a DNS name (underscores included, as some are), or an IPv6 literal.
_HOST = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+")


def _ascii_host(host: str, where: str, kind: str) -> str:
    """An internationalised name as DNS, the Host header and TLS know it (IDNA 2008, as httpx encodes
    names: the `idna` package)."""
    if host.isascii():
        return host
    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except idna.IDNAError as exc:
        raise APIError(400, f"{where}: host {host!r} is not a valid domain name ({exc})", param=where, code=f"invalid_{kind}_url") from None


class AddressGuard:
    def __init__(self, allowed_domains: tuple[str, ...], allowed_networks: tuple[str, ...]) -> None:
        self.allowed_domains = tuple(d.lower().lstrip(".") for d in allowed_domains)
        self.allowed_networks = tuple(ipaddress.ip_network(n, strict=False) for n in allowed_networks)

    def _domain_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return not self.allowed_domains or any(host == d or host.endswith("." + d) for d in self.allowed_domains)

    def _address_allowed(self, address: IPAddress) -> bool:
        plain = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped else address
        return any(plain in network for network in self.allowed_networks)

    async def check(self, url: str, where: str, kind: str = "image") -> Target:
        parts = _split(url, where, kind)
        if parts.scheme not in _DEFAULT_PORTS:
            raise APIError(400, f"{where}: URL scheme {parts.scheme!r} is not allowed (http, https or data: only)", param=where, code=f"unsupported_{kind}_url")
        host = parts.hostname
        if not host:
            raise APIError(400, f"{where}: URL has no host", param=where, code=f"invalid_{kind}_url")
        named = _ascii_host(host, where, kind)
        if not _HOST.fullmatch(named):  # a NUL ends the name for getaddrinfo, past what the allowed domains saw
            raise APIError(400, f"{where}: host {host!r} has characters no host name has", param=where, code=f"invalid_{kind}_url")
        if not (self._domain_allowed(host) or self._domain_allowed(named)):  # listed as written or as punycode
            raise APIError(400, f"{where}: host {host!r} is not in the allowed domains", param=where, code=f"{kind}_url_refused")
        try:
            port = _DEFAULT_PORTS[parts.scheme] if parts.port is None else parts.port
            if port == 0:
                raise ValueError("port 0")
        except ValueError:
            raise APIError(400, f"{where}: URL has an invalid port", param=where, code=f"invalid_{kind}_url") from None
        address = await self._resolve_checked(named, port, where, kind)
        netloc = f"[{address}]" if address.version == 6 else str(address)
        pinned = urlunsplit((parts.scheme, f"{netloc}:{port}", parts.path or "/", parts.query, ""))
        header_host = f"[{named}]" if ":" in named else named  # an IPv6 literal keeps its brackets in the Host header
        host_header = header_host if parts.port is None else f"{header_host}:{parts.port}"
        return Target(pinned, host_header, named if parts.scheme == "https" else None)

    async def _resolve_checked(self, host: str, port: int, where: str, kind: str) -> IPAddress:
        try:
            infos = await asyncio.get_running_loop().run_in_executor(_resolver, _lookup, host, port)
        except (socket.gaierror, UnicodeError):
            log.info("%s: host %r does not resolve; refused", where, host)
            raise _not_public(where, host, kind) from None
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        for address in addresses:  # every address must pass: DNS could hand out any of them
            reason = refusal_reason(address)
            if reason and not self._address_allowed(address):
                log.info("%s: host %r resolves to a %s address (%s); refused", where, host, reason, address)
                raise _not_public(where, host, kind)
        return addresses[0]


def _not_public(where: str, host: str, kind: str) -> APIError:
    """One answer, whether the name does not resolve or resolves to a refused address (the log tells
    which): telling the client would let it map the names and addresses of the gateway's network."""
    return APIError(400, f"{where}: host {host!r} does not resolve to a public address; fetching from it is refused",
                    param=where, code=f"{kind}_url_refused")


class ImageFetcher:
    def __init__(self, limits: FetchLimits, image_limits: ImageLimits) -> None:
        self.limits = limits
        self.image_limits = image_limits  # its byte limit caps every download
        self.guard = AddressGuard(limits.allowed_domains, limits.allowed_networks)
        timeout = httpx.Timeout(connect=limits.connect_timeout_s, read=limits.read_timeout_s, write=limits.read_timeout_s, pool=limits.connect_timeout_s)
        # trust_env=False: no proxy from the environment may route around the guard.
        # No keep-alive: pooled connections are keyed by the pinned address, so a
        # TLS connection verified for one host name could be reused for another.
        self.client = httpx.AsyncClient(
            timeout=timeout, follow_redirects=False, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)
        )

    async def fetch(self, url: str, where: str, byte_limits=None) -> bytes:
        """The body's bytes, held by the current request from here on (`hold`). `byte_limits`: another
        cap than the images' (anything with ImageLimits.check_bytes and its `noun`; videos')."""
        byte_limits = byte_limits or self.image_limits
        kind = byte_limits.noun
        try:
            async with asyncio.timeout(self.limits.total_timeout_s) as deadline:
                return await self._follow(url, where, byte_limits, deadline)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise APIError(504, f"{where}: fetching the {kind} timed out ({_expired(exc, self.limits)})", param=where, code=f"{kind}_fetch_timeout") from None
        except httpx.InvalidURL as exc:  # not an HTTPError: a path httpx will not send (control characters)
            raise APIError(400, f"{where}: invalid URL ({exc})", param=where, code=f"invalid_{kind}_url") from None
        except httpx.HTTPError as exc:
            raise APIError(400, f"{where}: fetching the {kind} failed ({type(exc).__name__})", param=where, code=f"{kind}_fetch_failed") from None

    async def _follow(self, url: str, where: str, byte_limits, deadline: asyncio.Timeout) -> bytes:
        kind = byte_limits.noun
        for _ in range(self.limits.max_redirects + 1):
            target = await self.guard.check(url, where, kind)
            extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
            # identity: a compressed body would be inflated before the byte cap could see it (a gzip bomb).
            headers = {"Host": target.host_header, "Accept-Encoding": "identity"}
            request = self.client.build_request("GET", target.url, headers=headers, extensions=extensions)
            response = await self.client.send(request, stream=True)
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = _redirected(url, response.headers["location"], where, kind)
                    continue
                if response.status_code != 200:
                    raise APIError(400, f"{where}: fetching the {kind} returned HTTP {response.status_code}", param=where, code=f"{kind}_fetch_failed")
                return await self._read_capped(response, where, byte_limits, deadline)
            finally:
                await response.aclose()
        raise APIError(400, f"{where}: more than {self.limits.max_redirects} redirects", param=where, code=f"{kind}_fetch_failed")

    async def _read_capped(self, response: httpx.Response, where: str, byte_limits, deadline: asyncio.Timeout) -> bytes:
        kind = byte_limits.noun
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise APIError(400, f"{where}: the {kind} server sent a {encoding}-encoded body though asked for none "
                           f"(Accept-Encoding: identity); {kind}s are fetched as stored", param=where, code=f"{kind}_fetch_failed")
        declared = response.headers.get("content-length", "")
        if declared.isdigit():
            byte_limits.check_bytes(int(declared), where)
        # Counted from the response on, by what it declares (the cap where it declares nothing, or
        # where a chunked encoding, not the length, says where the body ends): the body as it comes
        # and its copy. A host that never answers holds a socket, not the budget.
        chunked = "transfer-encoding" in response.headers
        expected = int(declared) if declared.isdigit() and not chunked else byte_limits.max_bytes
        async with self._room(BODY_COPIES * expected, where, deadline):
            chunks, size = [], 0
            async for chunk in response.aiter_raw():  # as sent: nothing is inflated
                size += len(chunk)
                byte_limits.check_bytes(size, where, "more than")  # stops reading: never buffers past the cap
                if size > expected:
                    raise APIError(400, f"{where}: the server sent more than the {expected} bytes it declared",
                                   param=where, code=f"{kind}_fetch_failed")
                chunks.append(chunk)
            hold(size)  # the request's from here: counted before the reservation ends
            return b"".join(chunks)  # with the chunks, the two copies counted (a bytearray grown by += takes up to 1/8 more)

    @contextlib.asynccontextmanager
    async def _room(self, nbytes: int, where: str, deadline: asyncio.Timeout):
        """`working(nbytes)` for the body's read; the wait for room is not the fetch's time (a full
        budget is a 503 memory_full, not a fetch timeout)."""
        loop = asyncio.get_running_loop()
        when, started = deadline.when(), loop.time()
        deadline.reschedule(None)
        async with working(nbytes, f"fetching {where}"):
            if when is not None:
                deadline.reschedule(when + loop.time() - started)
            yield

    async def close(self) -> None:
        await self.client.aclose()


def _redirected(url: str, location: str, where: str, kind: str) -> str:
    try:
        return urljoin(url, location)
    except ValueError as exc:
        raise APIError(400, f"{where}: the {kind} server redirected to an invalid URL ({exc})", param=where, code=f"{kind}_fetch_failed") from None


def _expired(exc: Exception, limits: FetchLimits) -> str:
    """Which deadline ran out, by its config key."""
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return f"gateway.fetch_connect_timeout_s = {limits.connect_timeout_s:g} s"
    if isinstance(exc, httpx.TimeoutException):
        return f"gateway.fetch_read_timeout_s = {limits.read_timeout_s:g} s"
    return f"gateway.fetch_total_timeout_s = {limits.total_timeout_s:g} s"
