"""The base of every wire message."""

import msgspec


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True, frozen=True):
    """A wire message. The class name travels as the tag; arrays travel beside it
    as raw frames, described by `ArrayMeta` fields in the message."""


class Hello(Message):
    """Handshake: sent by the gateway to a service, answered by its *Ready message."""

    sender: str
