"""How visual tokens leave the encoder (vision_encoder/handoff.py): pushed to
the request's engine, or pinned until an engine fetches them. A real Pusher
and a ROUTER standing for the engine; the encoder's service runs it end to end
in tests/integration/test_embedding_handoff.py."""

from __future__ import annotations

import msgspec
import pytest
import torch
import zmq

from cache import CachedEmbedding
from protocol.base import Hello
from protocol.sockets import Pusher
from protocol.to_encoder import FetchEmbeddings
from protocol.to_engine import PushedEmbedding
from tests.waiting import wait_until
from vision_encoder.batcher import Job
from vision_encoder.handoff import Handoff
from vision_encoder.work import PendingRequest

TOKENS = torch.randn(6, 128, dtype=torch.bfloat16)
VALUE = CachedEmbedding(TOKENS, (1, 4, 6), b"id")


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_pin_lasts_until_each_reference_is_fetched_or_it_expires(ctx):
    handoff = Handoff(10, Pusher(ctx, 1), 2**30)
    handoff.hold(b"k", VALUE, now=0)
    handoff.hold(b"k", VALUE, now=1)  # two requests handed the same image
    assert handoff.take(b"k", b"other") is None  # another identity: a collision, never served
    assert handoff.take(b"k", b"id") is VALUE and handoff.take(b"k", b"id") is VALUE
    assert handoff.take(b"k", b"id") is None and len(handoff) == 0
    handoff.hold(b"a", VALUE, now=0)
    handoff.hold(b"b", VALUE, now=5)
    handoff.expire(now=10)
    assert handoff.take(b"a", b"id") is None and handoff.take(b"b", b"id") is VALUE


def test_a_pin_counts_every_reference_when_the_image_comes_back_as_another_object(ctx):
    """The LRU let the image go between two requests, and the second got it from the shared tier
    (or encoded again): the first request's hold still counts, or its engine's fetch comes too late."""
    handoff = Handoff(10, Pusher(ctx, 1), 2**30)
    again = CachedEmbedding(TOKENS.clone(), (1, 4, 6), b"id")
    handoff.hold(b"k", VALUE, now=0)
    handoff.hold(b"k", again, now=1)
    assert handoff.take(b"k", b"id") is again and handoff.take(b"k", b"id") is again
    assert handoff.take(b"k", b"id") is None


def test_pins_past_their_byte_budget_go_oldest_first(ctx):
    """References never fetched (the engine had the tokens) pile up at a fast turnover: bounded."""
    handoff = Handoff(10, Pusher(ctx, 1), max_bytes=2 * TOKENS.nbytes)
    for now, key in enumerate([b"a", b"b", b"c"]):
        handoff.hold(key, CachedEmbedding(TOKENS.clone(), (1, 4, 6), b"id"), now=now)
    assert (len(handoff), handoff.held_bytes, handoff.pins_dropped) == (2, 2 * TOKENS.nbytes, 1)
    assert handoff.take(b"a", b"id") is None and handoff.take(b"c", b"id") is not None
    handoff.expire(now=100)
    assert (len(handoff), handoff.held_bytes) == (0, 0)


def encoded(request_id: str, push_to: str) -> tuple[Job, PendingRequest]:
    """A request's one image, just encoded, and the request waiting for it."""
    state = PendingRequest(b"gateway", request_id, 0.0, [(VALUE, False)], [request_id.encode()], push_to)
    return Job(request_id.encode(), None, 1, 0.0, b"id", [(state, 0)]), state


def connected(pusher: Pusher, address: str) -> None:
    """Until the pusher's connection to `address` takes a message (it is made at first use)."""
    wait_until(lambda: pusher.send(address, Hello("test")), 10, f"a connection to {address}", every_s=0.01)


def test_a_pushed_image_is_not_pinned_and_one_the_engine_did_not_take_is(ctx, tmp_path):
    engine_address = f"ipc://{tmp_path}/engine.sock"
    engine = ctx.socket(zmq.ROUTER)
    engine.bind(engine_address)
    handoff = Handoff(10, Pusher(ctx, 4), 2**30)
    # Nobody at this address: the push is refused, so the reference is pinned for the engine's fetch.
    job, state = encoded("nobody", f"ipc://{tmp_path}/nobody.sock")
    handoff.push(job, VALUE)
    [image] = handoff.references(state, now=0)
    assert (handoff.pushes, handoff.push_refusals, image.pushed, len(handoff)) == (0, 1, False, 1)
    # An engine that takes it: the tokens are there before the reference, and nothing is pinned.
    connected(handoff.pusher, engine_address)
    engine.recv_multipart()  # the probe
    job, state = encoded("taken", engine_address)
    handoff.push(job, VALUE)
    [image] = handoff.references(state, now=0)
    assert (handoff.pushes, image.pushed, len(handoff)) == (1, True, 1)
    _, header, frame = engine.recv_multipart()
    push = msgspec.msgpack.decode(header, type=PushedEmbedding)
    assert (push.key, push.identity, len(frame)) == (b"taken", b"id", TOKENS.numel() * 2)
    # A request whose client left takes no push.
    job, state = encoded("cancelled", engine_address)
    state.cancelled = True
    handoff.push(job, VALUE)
    assert handoff.pushes == 1 and not state.pushed


def test_a_fetch_is_answered_from_the_pins_then_the_lru_and_what_is_gone_is_none(ctx):
    handoff = Handoff(10, Pusher(ctx, 1), 2**30)
    handoff.hold(b"pinned", VALUE, now=0)
    lru = {b"cached": VALUE}
    answer, frames = handoff.answer(FetchEmbeddings("f", [b"pinned", b"cached", b"gone"], [b"id"] * 3),
                                    lambda key, identity: lru.get(key))
    assert answer.fetch_id == "f" and [meta is not None for meta in answer.found] == [True, True, False]
    assert len(frames) == 2 and (handoff.fetches, handoff.fetch_misses) == (2, 1) and len(handoff) == 0
