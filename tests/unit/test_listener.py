"""The gateway's socket (gateway/api/listener.py): its receive buffer,
which accepted connections inherit, lets a client send a whole image body
before the gateway reads any of it; past what the kernel grants it is left
to autotuning, with a warning naming the key; and it listens only once the app
serves, so a worker still starting takes no connections from those that serve."""

from __future__ import annotations

import logging
import select
import socket
from pathlib import Path

import pytest

from gateway.api.listener import bound_socket

BODY_BYTES = 1_500_000  # a 4K JPEG's request, a little over
BUFFER = 4 * 2**20


def listening_socket(host: str, port: int, **options) -> socket.socket:
    """The gateway's socket once uvicorn listens on it (it does once the app serves)."""
    sock = bound_socket(host, port, **options)
    sock.listen()
    return sock


def kernel_cap() -> int:
    """net.core.rmem_max, which the checks below must know to mean anything."""
    try:
        return int(Path("/proc/sys/net/core/rmem_max").read_text())
    except OSError:
        pytest.skip("net.core.rmem_max cannot be read here")


def receive_buffer(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def bytes_sent_unread(listener: socket.socket) -> tuple[int, socket.socket]:
    """How much of a body a client gets off its hands while the server reads
    nothing (the client's own send buffer kept small, so the figure is the
    server's window), and the accepted connection."""
    client = socket.socket(listener.family, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
    client.connect(listener.getsockname()[:2])
    client.setblocking(False)
    server_side, _ = listener.accept()
    body, sent = memoryview(b"x" * BODY_BYTES), 0
    while sent < BODY_BYTES:
        try:
            sent += client.send(body[sent:])
        except BlockingIOError:
            if not select.select([], [client], [], 0.5)[1]:
                break  # the window stayed shut: the server must read first
    client.close()
    return sent, server_side


def test_a_whole_body_fits_before_the_gateway_reads() -> None:
    if kernel_cap() < BUFFER:
        pytest.skip("net.core.rmem_max is below 4 MiB on this host")
    with listening_socket("127.0.0.1", 0, reuse_port=False, receive_buffer_bytes=BUFFER) as listener:
        assert receive_buffer(listener) >= BUFFER  # Linux reports twice what was set
        sent, connection = bytes_sent_unread(listener)
        with connection:
            assert receive_buffer(connection) == receive_buffer(listener)
        assert sent == BODY_BYTES
    with listening_socket("127.0.0.1", 0, reuse_port=False, receive_buffer_bytes=0) as listener:
        sent, connection = bytes_sent_unread(listener)
        connection.close()
        assert sent < BODY_BYTES / 2, "the kernel's own window took the body too: the check above could not fail"


def test_past_what_the_kernel_grants_autotuning_is_left_on(caplog) -> None:
    asked = 64 * 2**20  # the key's maximum
    if kernel_cap() * 2 >= asked:
        pytest.skip("net.core.rmem_max grants 64 MiB on this host")
    with socket.socket() as plain:
        default = receive_buffer(plain)
    with caplog.at_level(logging.WARNING, logger="prism.gateway"):
        with listening_socket("127.0.0.1", 0, reuse_port=False, receive_buffer_bytes=asked) as listener:
            assert receive_buffer(listener) == default
            sent, connection = bytes_sent_unread(listener)
            connection.close()
    assert sent < BODY_BYTES / 2  # the kernel's own window, as with the key at 0
    assert "gateway.socket_receive_buffer_bytes" in caplog.text and "rmem_max" in caplog.text


def test_workers_share_the_port() -> None:
    with listening_socket("127.0.0.1", 0, reuse_port=True, receive_buffer_bytes=0) as first:
        port = first.getsockname()[1]
        with listening_socket("127.0.0.1", port, reuse_port=True, receive_buffer_bytes=0) as second:
            assert second.getsockname()[1] == port
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", port, reuse_port=False, receive_buffer_bytes=0)


def test_a_worker_that_does_not_serve_yet_takes_no_connections() -> None:
    """Bound beside a serving worker (SO_REUSEPORT), a starting one's socket listens only once its app
    serves: until then the kernel gives every connection to the one that serves, none to its queue."""
    with listening_socket("127.0.0.1", 0, reuse_port=True, receive_buffer_bytes=0) as serving:
        port = serving.getsockname()[1]
        with bound_socket("127.0.0.1", port, reuse_port=True, receive_buffer_bytes=0):
            serving.settimeout(5)
            for _ in range(32):
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    serving.accept()[0].close()  # each one here, or it waits in the other's queue: a timeout
