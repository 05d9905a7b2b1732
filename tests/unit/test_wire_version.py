"""The wire's version (protocol/base.py PROTOCOL) moves whenever a message's shape does.

Messages travel as arrays: a field moved, added before others, retyped, or given
another default (a sender leaves out a field equal to its default, and the
receiver reads its own) is read by a peer of the last release as something else.
Each release's tag carries PROTOCOL, so peers of two versions skip each other's
messages instead, and their handshake says which versions met: this test fails
while a shape changes under an unchanged PROTOCOL.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import pkgutil

import msgspec

import protocol
from protocol.base import PROTOCOL, Hello, Message, WrongProtocol, answer_hello
from protocol.to_gateway import EngineReady

# PROTOCOL → the digest of every wire struct's shape under it. A change of shape: bump PROTOCOL
# and add its digest here (the failure prints it); never edit an old one.
SHAPES = {
    1: "23015121599aa54f",
    2: "d0196a51e578797d",  # the handshakes carry the checkpoint's vision weights (common/checkpoint.py)
    3: "4cfd2da48c644a96",  # priority in encode requests, engines' scheduling policy, token ids and prompt logprobs in deltas
    4: "dafd4dd0f0d2e37b",  # the prompt's text in deltas, generate requests' priority, empty content, displaced counts
    5: "4ab9ac6dd4848624",  # engines' handshakes say what their parsers can do (thinking budgets, special tokens kept)
}


# A gateway's video decoders are its own children, started from its own files: their messages
# never meet another release's (protocol/decoder.py).
SAME_RELEASE_ONLY = {"decoder"}


def _wire_structs() -> list[type]:
    structs = set()
    for info in pkgutil.iter_modules(protocol.__path__):
        if info.name in SAME_RELEASE_ONLY:
            continue
        module = importlib.import_module(f"protocol.{info.name}")
        structs.update(obj for _, obj in inspect.getmembers(module, inspect.isclass)
                       if issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__ and obj is not Message)
    return sorted(structs, key=lambda cls: cls.__name__)


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.default_factory is not msgspec.NODEFAULT:
        return repr(field.default_factory())
    return "required" if field.default is msgspec.NODEFAULT else repr(field.default)


def wire_shape_digest() -> str:
    """Every wire struct's fields in order (name, type as JSON schema, default), its version left out of its tag."""
    structs = _wire_structs()
    _, components = msgspec.json.schema_components(structs)
    shapes = {cls.__name__: {"fields": [(field.name, _default(field)) for field in msgspec.structs.fields(cls)]}
              for cls in structs}
    text = json.dumps([_without_words(components), shapes], sort_keys=True).replace(f'/v{PROTOCOL}"', '"')
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_words(node):
    """A schema less its docstrings (prose, not shape)."""
    if isinstance(node, dict):
        return {key: _without_words(value) for key, value in node.items() if key not in ("description", "title")}
    if isinstance(node, list):
        return [_without_words(value) for value in node]
    return node


def test_every_change_of_a_wire_message_s_shape_moves_the_protocol_version():
    digest = wire_shape_digest()
    step = "record" if PROTOCOL not in SHAPES else "bump protocol.base.PROTOCOL and record"
    version = PROTOCOL if PROTOCOL not in SHAPES else PROTOCOL + 1
    assert SHAPES.get(PROTOCOL) == digest, (
        f"the wire's shapes are {digest}, not the {SHAPES.get(PROTOCOL)!r} recorded for v{PROTOCOL}: a message changed "
        f"shape, so a peer of the last release would misread it: {step} {{{version}: {digest!r}}} in SHAPES "
        "(if the change itself was a mistake, undo it instead)")


def test_the_handshake_s_two_messages_keep_their_shape_and_tag_for_every_version():
    """Peers of any two versions read them: a gateway's hello, a service's answer that it speaks another."""
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Hello("gateway", 3))) == ["Hello", "gateway", 3]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(WrongProtocol(3))) == ["WrongProtocol", 3]
    # and a Hello from before versions were said (no version at all) is read as version 0
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(["Hello", "gateway"]), type=Hello) == Hello("gateway", 0)


def test_every_other_message_s_tag_carries_the_version():
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(EngineReady("m", 1)))[0] == f"EngineReady/v{PROTOCOL}"


def test_a_service_answers_a_hello_of_its_own_version_with_its_ready_and_another_with_its_version():
    ready = EngineReady("m", 1)
    assert answer_hello(Hello("gateway", PROTOCOL), ready) is ready
    assert answer_hello(Hello("gateway", PROTOCOL + 1), ready) == WrongProtocol(PROTOCOL)
    assert answer_hello(Hello("gateway"), ready) == WrongProtocol(PROTOCOL)  # a gateway from before versions
