"""The gateway's references to images' visual tokens (gateway/routing/handoff.py KnownTokens)."""

from __future__ import annotations

from gateway.routing.handoff import KnownTokens
from protocol.tensors import ArrayMeta
from protocol.to_engine import ImageEmbedding


def ref(name: str, pushed: bool = False) -> ImageEmbedding:
    return ImageEmbedding(ArrayMeta("bfloat16", (25, 128)), (1, 10, 10), name.encode(), "ipc:///encoder", b"id-" + name.encode(), pushed)


def test_a_request_is_recalled_only_when_every_image_is_known():
    known = KnownTokens()
    known.remember([b"a", b"b"], [ref("a"), ref("b")])
    assert known.recall([b"b", b"a"]) == [ref("b"), ref("a")]
    assert known.recall([b"a", b"c"]) is None


def test_a_push_is_for_its_own_request_only():
    known = KnownTokens()
    known.remember([b"a"], [ref("a", pushed=True)])
    assert known.recall([b"a"]) == [ref("a", pushed=False)]


def test_the_least_recently_used_reference_goes_first():
    known = KnownTokens(capacity=2)
    known.remember([b"a", b"b"], [ref("a"), ref("b")])
    known.recall([b"a"])  # a is used again: b is now the oldest
    known.remember([b"c"], [ref("c")])
    assert len(known) == 2
    assert known.recall([b"b"]) is None
    assert known.recall([b"a"]) == [ref("a")] and known.recall([b"c"]) == [ref("c")]


def test_forgotten_references_are_not_recalled():
    known = KnownTokens()
    known.remember([b"a", b"b"], [ref("a"), ref("b")])
    known.forget([b"a", b"x"])
    assert known.recall([b"a"]) is None
    assert known.recall([b"b"]) == [ref("b")]
