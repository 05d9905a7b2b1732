"""The gateway's listening socket, built here rather than by uvicorn because
two of its options must be set before `listen()`:

- SO_REUSEPORT when several gateway workers share the port (the kernel
  spreads new connections over them; gateway/workers.py);
- SO_RCVBUF (`gateway.socket_receive_buffer_bytes`), which accepted
  connections inherit, and whose TCP window scale is fixed at the handshake.

Why a large receive buffer: an image request's body is 0.3-1.3 MB of base64.
With the kernel's starting buffer (net.ipv4.tcp_rmem's middle figure, 128 KB
here) the client may send only a window's worth before the gateway reads, so
under load the body trickles in as the gateway finds turns to drain it, and
`parse` grows by every turn it waits (docs/architecture.md, "Where `parse`
waits"). With room for the whole body the client finishes at once and the
gateway reads it in one piece. The kernel allocates the buffer only as data
arrives, so an idle connection costs nothing; all of them together stay under
net.ipv4.tcp_mem.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

log = logging.getLogger("prism.gateway")

BACKLOG = 2048  # uvicorn's default
_RMEM_MAX = Path("/proc/sys/net/core/rmem_max")


def kernel_receive_buffer_max() -> int | None:
    """net.core.rmem_max: the most SO_RCVBUF may ask for (None: not Linux)."""
    try:
        return int(_RMEM_MAX.read_text())
    except (OSError, ValueError):
        return None


def listening_socket(host: str, port: int, *, reuse_port: bool, receive_buffer_bytes: int,
                     receive_buffer_max: int | None = None) -> socket.socket:
    """A socket listening on the first address `host` resolves to (the
    configs give IP literals), as uvicorn would bind it, plus the two options
    above. `receive_buffer_max` defaults to the kernel's."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if receive_buffer_bytes:
            kernel_max = kernel_receive_buffer_max() if receive_buffer_max is None else receive_buffer_max
            set_receive_buffer(sock, receive_buffer_bytes, kernel_max)
        sock.bind(address)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def set_receive_buffer(sock: socket.socket, size: int, kernel_max: int | None) -> None:
    """Set SO_RCVBUF unless the kernel would cap it: a capped buffer is both
    smaller than asked and fixed, where the kernel's autotuning could have
    grown it past the cap (to net.ipv4.tcp_rmem's last figure)."""
    if kernel_max is not None and size > kernel_max:
        log.warning("gateway.socket_receive_buffer_bytes (%d) is above net.core.rmem_max (%d): leaving the kernel's "
                    "receive buffer autotuning on instead; raise net.core.rmem_max on the host, or lower the key",
                    size, kernel_max)
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
