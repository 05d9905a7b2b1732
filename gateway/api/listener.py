"""The gateway's socket, built here rather than by uvicorn because two of its
options must be set before `listen()`:

- SO_REUSEPORT when several gateway workers share the port (the kernel
  spreads new connections over them; gateway/ops/workers.py);
- SO_RCVBUF (`gateway.socket_receive_buffer_bytes`), which accepted
  connections inherit, and whose TCP window scale is fixed at the handshake.

It is bound here (a port in use stops the gateway at once) but listens only
once the app serves: uvicorn calls `listen()` after the lifespan's start-up,
which waits for the encoders' and engines' handshakes. Until then a
connection is refused rather than held unanswered, and a restarted worker
among several takes none: the kernel spreads connections over listening
sockets only.

Why a large receive buffer: an image request's body is 0.3-1.3 MB of base64.
With the kernel's starting buffer (net.ipv4.tcp_rmem's middle figure, 128 KB
here) the client may send only a window's worth before the gateway reads, so
under load the body trickles in as the gateway finds turns to drain it, and
`parse` grows by every turn it waits (docs/measurements/floor.md, "Where
`parse` waits"). With room for the whole body the client finishes at once and the
gateway reads it in one piece. The kernel allocates the buffer only as data
arrives, so an idle connection costs nothing; all of them together stay under
net.ipv4.tcp_mem.
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger("prism.gateway")


def bound_socket(host: str, port: int, *, reuse_port: bool, receive_buffer_bytes: int) -> socket.socket:
    """A socket bound to the first address `host` resolves to (the configs give
    IP literals), as uvicorn would bind it, plus the two options above; not
    listening yet (uvicorn listens once the app serves)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = _unbound(family, kind, proto, reuse_port)
    try:
        if receive_buffer_bytes and not _receive_buffer_granted(sock, receive_buffer_bytes):
            sock.close()  # its buffer is fixed at what the kernel granted: start afresh, with autotuning
            sock = _unbound(family, kind, proto, reuse_port)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _unbound(family: int, kind: int, proto: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def _receive_buffer_granted(sock: socket.socket, size: int) -> bool:
    """Ask for `size` bytes of SO_RCVBUF; False if the kernel granted less.
    Linux caps the request at net.core.rmem_max, then doubles it for its
    own bookkeeping and reports the doubled figure (so this holds where the
    cap is at least half of `size`). A capped buffer is both smaller than
    asked and fixed, where the kernel's autotuning could have grown it past
    the cap (to net.ipv4.tcp_rmem's last figure). What was granted is read
    from the socket, not /proc: a container may not see the host's sysctl."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    if granted >= size:
        return True
    log.warning("gateway.socket_receive_buffer_bytes (%d) is more than the kernel grants (%d; net.core.rmem_max caps "
                "it): leaving the kernel's receive buffer autotuning on instead; raise net.core.rmem_max on the host, "
                "or lower the key", size, granted)
    return False
