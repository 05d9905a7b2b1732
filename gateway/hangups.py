"""SIGHUP, which reloads the routing map, held from a gateway process's first
line: one that comes while the gateway still starts (importing, waiting for
its services' handshakes) is kept and acted on once it serves, rather than
lost, or fatal (its default action). The app's lifespan takes the signal over
once it serves (gateway/api/app.py)."""

from __future__ import annotations

import signal

_pending = False


def hold_hangups() -> None:
    signal.signal(signal.SIGHUP, _remember)


def _remember(signum, frame) -> None:
    global _pending
    _pending = True


def take_pending() -> bool:
    """Whether a SIGHUP came while it was held (and no more after this)."""
    global _pending
    pending, _pending = _pending, False
    return pending
