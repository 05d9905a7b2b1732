"""The base of every wire message, and the handshake every service answers.

Messages are arrays (`array_like`): their fields travel by position, so a peer
built from another release could read one field as another without an error.
The wire's version therefore travels in every message's tag ("EncodeRequest/v2"):
a message from a peer of another version is skipped as unreadable, never
misread. Only the handshake's two messages keep one shape and tag for ever, so
that peers of any two versions can tell each other which they speak.
"""

from __future__ import annotations

import logging

import msgspec

# Bumped whenever a wire message changes shape (tests/unit/test_wire_version.py records each shape).
PROTOCOL = 5

log = logging.getLogger("prism.protocol")


def _versioned(class_name: str) -> str:
    return f"{class_name}/v{PROTOCOL}"


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=_versioned, frozen=True):
    """A wire message. The class name and the wire's version travel as the tag; arrays
    travel beside it as raw frames, described by `ArrayMeta` fields in the message."""


class Hello(Message, tag="Hello"):
    """Handshake: sent by the gateway to a service, answered by its *Ready message, or by
    WrongProtocol where the two speak different versions. Its shape never changes."""

    sender: str
    protocol: int = 0  # the sender's PROTOCOL (0: a gateway from before versions were said)


class WrongProtocol(Message, tag="WrongProtocol"):
    """A service's answer to a Hello of another version than its own: nothing else it
    says could be read by that gateway, nor the gateway's requests by it. Its shape never changes."""

    protocol: int  # the version the service speaks


_refused_versions: set[int] = set()  # logged once each: a gateway says hello every two seconds while it waits


def answer_hello(hello: Hello, ready: msgspec.Struct) -> msgspec.Struct:
    """What a service answers a Hello: its Ready, or WrongProtocol to a peer of another version."""
    if hello.protocol == PROTOCOL:
        return ready
    if hello.protocol not in _refused_versions:
        _refused_versions.add(hello.protocol)
        log.error("%s speaks wire protocol v%d, this service v%d: it is answered that and nothing else "
                  "(run one release on both sides)", hello.sender, hello.protocol, PROTOCOL)
    return WrongProtocol(PROTOCOL)
