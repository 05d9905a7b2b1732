"""A SIGHUP that comes while the gateway starts is kept for once it serves (gateway/hangups.py)."""

from __future__ import annotations

import os
import signal

from gateway.hangups import hold_hangups, take_pending


def test_a_hangup_while_starting_is_kept_once_and_kills_nothing():
    before = signal.getsignal(signal.SIGHUP)
    try:
        hold_hangups()
        assert not take_pending()
        os.kill(os.getpid(), signal.SIGHUP)  # its default action would end this process
        assert take_pending() and not take_pending()
    finally:
        signal.signal(signal.SIGHUP, before)
