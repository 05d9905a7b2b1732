"""The SSRF guard's address rules (pure functions: nothing is connected to)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading

import pytest

from gateway.errors import APIError
from gateway.intake.fetch import AddressGuard, refusal_reason

REFUSED = [
    "127.0.0.1", "127.5.5.5", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "224.0.0.1", "240.0.0.1", "0.0.0.0", "255.255.255.255", "::", "::1", "fe80::1", "fc00::1", "ff02::1",
    "::ffff:10.0.0.1", "::ffff:127.0.0.1", "2001:db8::1", "fec0::1",
    "2002:7f00:1::1", "2002:a00:1::", "2002:a9fe:a9fe::1",  # 6to4 around loopback, private, link-local
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8", "2002:808:808::1"]


@pytest.mark.parametrize("address", REFUSED)
def test_non_public_addresses_are_refused(address):
    assert refusal_reason(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass(address):
    assert refusal_reason(ipaddress.ip_address(address)) is None


def check(guard: AddressGuard, url: str):
    return asyncio.run(guard.check(url, "messages[0].content[0]"))


@pytest.mark.parametrize("url", ["http://10.0.0.1/a.png", "http://169.254.169.254/latest/meta-data", "https://[fd00::1]/x", "http://3232235777/"])
def test_guard_refuses_private_literals_before_any_connection(url):
    with pytest.raises(APIError, match="refused"):
        check(AddressGuard((), ()), url)


def test_a_refusal_names_what_was_fetched():
    where = "messages[0].content[0]"
    for kind in ("image", "video"):
        with pytest.raises(APIError) as refused:
            asyncio.run(AddressGuard((), ()).check("http://10.0.0.1/x", where, kind))
        assert refused.value.code == f"{kind}_url_refused"
        with pytest.raises(APIError) as unsupported:
            asyncio.run(AddressGuard((), ()).check("ftp://example.com/x", where, kind))
        assert unsupported.value.code == f"unsupported_{kind}_url"


def test_allowed_network_is_an_explicit_opt_in():
    target = check(AddressGuard((), ("10.0.0.0/8",)), "http://10.1.2.3:8080/a.png?x=1")
    assert target.url == "http://10.1.2.3:8080/a.png?x=1" and target.host_header == "10.1.2.3:8080"


def test_https_target_is_pinned_with_sni_and_host_header():
    guard = AddressGuard((), ("127.0.0.0/8",))
    target = check(guard, "https://localhost/img.png")
    assert target.url.startswith("https://127.0.0.1:443/") or target.url.startswith("https://[::1]:443/")
    assert (target.host_header, target.sni_hostname) == ("localhost", "localhost")


def test_domain_allowlist():
    guard = AddressGuard(("example.org",), ("127.0.0.0/8", "::1/128"))
    with pytest.raises(APIError, match="not in the allowed domains"):
        check(guard, "http://localhost/a.png")
    with pytest.raises(APIError, match="not in the allowed domains"):
        check(guard, "http://evil-example.org/a.png")


@pytest.mark.parametrize("url,needle", [("file:///etc/passwd", "scheme 'file'"), ("gopher://x/", "scheme 'gopher'"), ("http:///nohost", "no host"), ("http://h:99999/", "invalid port"),
                                        ("http://h:0/", "invalid port")])
def test_malformed_urls(url, needle):
    with pytest.raises(APIError, match=needle):
        check(AddressGuard((), ()), url)


@pytest.mark.parametrize("url,needle", [("http://[::1/x.png", "invalid URL"), ("http://[abc]/x.png", "invalid URL"),
                                        ("http://-bad-.bücher.de/x.png", "not a valid domain name")])
def test_urls_python_cannot_parse_are_a_400_not_a_500(url, needle):
    with pytest.raises(APIError, match=needle) as refused:
        check(AddressGuard((), ()), url)
    assert refused.value.status == 400


@pytest.mark.parametrize("url", ["http://1.2.3.4\x00.example.org/a.png", "https://1.2.3.4\x00.example.org/a.png",
                                 "http://a b.example.org/a.png"])
def test_a_host_with_characters_no_host_has_is_refused_before_it_is_resolved(url):
    """getaddrinfo reads the name up to its NUL: 1.2.3.4, past the allowed domains that saw the whole
    string (over TLS, a 500 from the wrap)."""
    with pytest.raises(APIError, match="characters no host name has") as refused:
        check(AddressGuard(("example.org",), ()), url)
    assert refused.value.status == 400


def test_an_ipv6_literal_keeps_its_brackets_in_the_host_header():
    target = check(AddressGuard((), ("::1/128",)), "http://[::1]:8080/a.png")
    assert (target.url, target.host_header) == ("http://[::1]:8080/a.png", "[::1]:8080")


def test_an_internationalised_name_is_resolved_and_sent_as_punycode(monkeypatch):
    """DNS, the Host header and TLS take the ASCII form: a Host header of raw UTF-8 failed every such URL with a 500."""
    asked = []

    async def resolve(self, host, port, where, kind):
        asked.append(host)
        return ipaddress.ip_address("93.184.216.34")

    monkeypatch.setattr(AddressGuard, "_resolve_checked", resolve)
    target = check(AddressGuard(("xn--bcher-kva.de",), ()), "https://bücher.de/a.png")
    assert asked == ["xn--bcher-kva.de"]
    assert (target.host_header, target.sni_hostname) == ("xn--bcher-kva.de", "xn--bcher-kva.de")


async def _lookups_that_never_answer_beside_the_loop_s_other_work(guard: AddressGuard, stuck: int) -> str:
    async def fetch_deadline(url: str):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):  # the fetch's total deadline: the lookup's thread stays blocked past it
                await guard.check(url, "messages[0].content[0]")

    await asyncio.gather(*(fetch_deadline(f"http://slow{i}.example/a.png") for i in range(stuck)))
    # The default executor serves the gateway's own work (discovery, the heap trim): still free.
    return await asyncio.wait_for(asyncio.to_thread(lambda: "the default executor answered"), 10)


def test_host_lookups_that_never_answer_hold_threads_of_their_own(monkeypatch):
    """A user's URL may name a host whose name servers never answer: getaddrinfo
    blocks past the fetch's deadline. Those lookups must not take the threads
    that the rest of the gateway's work runs on."""
    release, threads = threading.Event(), set()

    def getaddrinfo(host, port, *args, **kwargs):
        threads.add(threading.current_thread().name)
        if host.startswith("slow"):
            release.wait(60)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        answered = asyncio.run(_lookups_that_never_answer_beside_the_loop_s_other_work(AddressGuard((), ()), stuck=12))
        assert answered == "the default executor answered"
        assert threads and all(name.startswith("prism-dns") for name in threads), threads
        assert check(AddressGuard((), ()), "http://fast.example/a.png").url == "http://93.184.216.34:80/a.png"
    finally:
        release.set()


def test_a_host_that_does_not_resolve_and_one_that_resolves_to_a_private_address_get_one_answer():
    """Two answers would let a client map the names and addresses of the gateway's network."""
    answers = []
    for host in ("no-such-host.invalid", "localhost"):
        with pytest.raises(APIError) as refused:
            check(AddressGuard((), ()), f"http://{host}/a.png")
        answers.append((refused.value.status, refused.value.code, refused.value.message.replace(host, "HOST")))
    assert answers[0] == answers[1] and "127.0.0.1" not in answers[1][2]
