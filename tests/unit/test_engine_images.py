"""Where the engine finds each image's tokens (llm_engine/images.py), against a
ROUTER answering as an encoder does. The real encoder and engine are tested end
to end in tests/integration/test_embedding_handoff.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest
import torch
import zmq.asyncio

from llm_engine.images import EmbeddingsUnavailable, EngineImages
from protocol.sockets import AsyncRouter
from protocol.tensors import ArrayMeta, meta_of, to_frame
from protocol.to_encoder import EncoderInbound, FetchEmbeddings
from protocol.to_engine import FetchedEmbeddings, GenerateRequest, ImageEmbedding, PushedEmbedding
from protocol.video import VideoEmbedding
from tests.waiting import wait_until_async

TOKENS = torch.randn(6, 128, dtype=torch.bfloat16)


def reference(key: bytes, source: str, tensor=TOKENS) -> ImageEmbedding:
    return ImageEmbedding(meta_of(tensor), (1, 4, 6), key, source, b"id-" + key)


class Encoder:
    """Answers fetches as the encoder does, from `held` (key → tensor); counts them."""

    def __init__(self, ctx, address: str, held: dict[bytes, torch.Tensor]) -> None:
        self.router = AsyncRouter(ctx, address, EncoderInbound)
        self.held, self.asked = held, []
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            peer, message, _ = await self.router.recv()
            assert isinstance(message, FetchEmbeddings)
            self.asked.append(list(message.keys))
            found = [self.held.get(key) for key in message.keys]
            frames = [to_frame(t)[1] for t in found if t is not None]
            await self.router.send(peer, FetchedEmbeddings(message.fetch_id, [None if t is None else meta_of(t) for t in found]), frames)

    def close(self) -> None:
        self.task.cancel()
        self.router.close()


@contextlib.asynccontextmanager
async def encoder_and_fetcher(source: str, held: dict[bytes, torch.Tensor], **fetcher_args):
    """An answering encoder at `source` and an engine's fetcher, closed after."""
    ctx = zmq.asyncio.Context()
    encoder = Encoder(ctx, source, held)
    fetcher = EngineImages(ctx, **{"capacity_bytes": 2**20, "timeout_s": 0.5, **fetcher_args})
    try:
        yield encoder, fetcher
    finally:
        encoder.close()
        fetcher.close()
        ctx.destroy(linger=0)


async def _fetches() -> None:
    async with encoder_and_fetcher("inproc://encoder-a", {b"a": TOKENS, b"b": TOKENS * 2}) as (encoder, fetcher):
        got = await fetcher.tensors([reference(b"a", "inproc://encoder-a"), reference(b"b", "inproc://encoder-a")])
        assert torch.equal(got[0], TOKENS) and torch.equal(got[1], TOKENS * 2)
        moved = fetcher.fetched_bytes
        assert moved > 2 * TOKENS.numel() * 2 and encoder.asked == [[b"a", b"b"]]
        again = await fetcher.tensors([reference(b"b", "inproc://encoder-a")])  # the engine's LRU: nothing moves
        assert torch.equal(again[0], TOKENS * 2) and fetcher.fetched_bytes == moved and len(encoder.asked) == 1
        with pytest.raises(EmbeddingsUnavailable, match="no longer held by inproc://encoder-a"):
            await fetcher.tensors([reference(b"gone", "inproc://encoder-a")])
        with pytest.raises(EmbeddingsUnavailable, match="engine.embed_fetch_timeout_s"):  # nobody there: bounded
            await asyncio.wait_for(fetcher.tensors([reference(b"z", "inproc://nobody")]), 5)


def test_the_engine_fetches_by_reference_keeps_an_lru_and_never_waits_unbounded():
    asyncio.run(_fetches())


async def _concurrent_requests_fetch_an_image_once() -> None:
    async with encoder_and_fetcher("inproc://encoder-burst", {b"a": TOKENS}) as (encoder, fetcher):
        burst = await asyncio.gather(*(fetcher.tensors([reference(b"a", "inproc://encoder-burst")]) for _ in range(3)))
        assert all(torch.equal(got[0], TOKENS) for got in burst)
        assert encoder.asked == [[b"a"]] and (fetcher.fetched, fetcher.joined) == (1, 2)
        # A fetch that brings nothing leaves each waiter to ask for itself: both fail, neither hangs.
        gone = await asyncio.gather(*(fetcher.tensors([reference(b"gone", "inproc://encoder-burst")]) for _ in range(2)),
                                    return_exceptions=True)
        assert all(isinstance(error, EmbeddingsUnavailable) for error in gone)
        assert encoder.asked[1:] == [[b"gone"], [b"gone"]] and not fetcher._fetching


def test_concurrent_requests_for_one_new_image_fetch_it_once():
    asyncio.run(_concurrent_requests_fetch_an_image_once())


def pushed_reference(key: bytes, source: str) -> ImageEmbedding:
    return msgspec.structs.replace(reference(key, source), pushed=True)


def push(fetcher: EngineImages, key: bytes, tensor: torch.Tensor) -> None:
    meta, frame = to_frame(tensor)
    fetcher.received(PushedEmbedding(key, b"id-" + key, meta, (1, 4, 6)), [frame])


async def _pushes() -> None:
    source = "inproc://encoder-push"
    async with encoder_and_fetcher(source, {b"late": TOKENS * 3}, push_wait_s=0.3) as (encoder, fetcher):
        push(fetcher, b"a", TOKENS)  # before its request: it is used, nothing is fetched
        got = await fetcher.tensors([pushed_reference(b"a", source)])
        assert torch.equal(got[0], TOKENS) and fetcher.pushed == 1 and fetcher.cache.stats.hits == 0
        waiting = asyncio.create_task(fetcher.tensors([pushed_reference(b"b", source)]))
        await wait_until_async(lambda: (b"b", b"id-b") in fetcher._awaited, 5, "the request waiting for its push",
                               observe=lambda: list(fetcher._awaited))  # the request first
        push(fetcher, b"b", TOKENS * 2)
        assert torch.equal((await waiting)[0], TOKENS * 2) and fetcher.pushed == 2
        assert encoder.asked == [] and fetcher.pushed_bytes == 2 * TOKENS.numel() * 2
        started = time.monotonic()  # a push that never comes: fetched once push_wait_s has passed
        got = await fetcher.tensors([pushed_reference(b"late", source)])
        assert torch.equal(got[0], TOKENS * 3) and time.monotonic() - started >= 0.3
        assert encoder.asked == [[b"late"]] and not fetcher._awaited
        again = await fetcher.tensors([pushed_reference(b"a", source)])  # a repeat is a plain hit
        assert torch.equal(again[0], TOKENS) and (fetcher.pushed, fetcher.cache.stats.hits) == (2, 1)
        fetcher.received(PushedEmbedding(b"c", b"id-c", meta_of(TOKENS), None), [])  # malformed: dropped, not raised
        fetcher.received(PushedEmbedding(b"d", b"id-d", meta_of(TOKENS), None), [b"short"])
        integers = TOKENS.to(torch.int16)  # the size of the bf16 tokens, of no token dtype
        fetcher.received(PushedEmbedding(b"e", b"id-e", meta_of(integers), None), [integers.numpy().tobytes()])
        assert all(fetcher.cache.get(k, b"id-" + k, record=False) is None for k in (b"c", b"d", b"e"))


def test_pushed_tokens_are_used_whether_they_come_before_or_after_the_request_and_fetched_if_they_never_come():
    asyncio.run(_pushes())


async def _tokens_not_as_referenced() -> None:
    source = "inproc://encoder-wrong"
    wrong = torch.randn(3, 5)
    async with encoder_and_fetcher(source, {b"w": TOKENS, b"v": wrong}, push_wait_s=0.3) as (encoder, fetcher):
        push(fetcher, b"w", wrong)  # a push of another dtype and shape than the request references: fetched instead
        got = await fetcher.tensors([pushed_reference(b"w", source)])
        assert torch.equal(got[0], TOKENS) and encoder.asked == [[b"w"]] and fetcher.pushed == 0
        with pytest.raises(EmbeddingsUnavailable):  # an encoder holding another shape: not held (a 503), not the request's fault
            await fetcher.tensors([reference(b"v", source)])


def test_tokens_that_are_not_what_the_request_references_are_never_used():
    asyncio.run(_tokens_not_as_referenced())


def watch_push_waits(fetcher: EngineImages) -> list[list[bytes]]:
    """Each time a request waits (up to push_wait_s) for pushes on their way: their keys."""
    waits_for_pushes = []
    await_pushes = fetcher._await_pushes

    async def watched(images, awaited, found) -> None:
        waits_for_pushes.append([images[index].key for index in awaited])
        await await_pushes(images, awaited, found)

    fetcher._await_pushes = watched
    return waits_for_pushes


async def _evicted_push() -> None:
    source = "inproc://encoder-evicted"
    async with encoder_and_fetcher(source, {b"x": TOKENS}, capacity_bytes=TOKENS.numel() * 2, push_wait_s=5) as (encoder, fetcher):  # holds one
        push(fetcher, b"x", TOKENS)
        push(fetcher, b"y", TOKENS * 2)  # evicts x
        waits_for_pushes = watch_push_waits(fetcher)
        got = await fetcher.tensors([pushed_reference(b"x", source)])
        assert torch.equal(got[0], TOKENS) and encoder.asked == [[b"x"]]
        assert waits_for_pushes == [] and fetcher.pushed == 0 and not fetcher._awaited  # fetched at once, no push awaited


def test_a_push_that_arrived_and_was_evicted_is_fetched_without_waiting_for_it():
    asyncio.run(_evicted_push())


async def _push_waited_out() -> None:
    source = "inproc://encoder-overdue"
    async with encoder_and_fetcher(source, {}, push_wait_s=0.3) as (encoder, fetcher):
        waits_for_pushes = watch_push_waits(fetcher)
        for _ in range(2):  # the second request knows the first waited in vain: it fetches at once
            with pytest.raises(EmbeddingsUnavailable):
                await fetcher.tensors([pushed_reference(b"lost", source)])
        assert waits_for_pushes == [[b"lost"]] and encoder.asked == [[b"lost"], [b"lost"]]
        push(fetcher, b"lost", TOKENS)  # late after all: found here, nothing fetched
        got = await fetcher.tensors([pushed_reference(b"lost", source)])
        assert torch.equal(got[0], TOKENS) and len(encoder.asked) == 2 and fetcher.pushed == 1


def test_a_push_one_request_waited_out_is_not_waited_for_again():
    asyncio.run(_push_waited_out())


def test_a_request_for_another_engine_than_the_pushed_one_waits_for_no_push():
    request = GenerateRequest("r", b"{}", [pushed_reference(b"a", "tcp://e"), reference(b"b", "tcp://e")])
    assert not any(image.pushed for image in request.unpushed().images)
    plain = GenerateRequest("r", b"{}", [reference(b"b", "tcp://e")])
    assert plain.unpushed() is plain


def test_a_failover_request_fetches_its_pushed_videos_too():
    video = VideoEmbedding(ArrayMeta("float32", (4, 8)), (1, 4, 4), key=b"v", source="tcp://e", identity=b"v", pushed=True)
    request = GenerateRequest("r", b"{}", [reference(b"b", "tcp://e")], [video])
    assert not any(item.pushed for item in (*request.unpushed().images, *request.unpushed().videos))


async def _encoders_forgotten() -> None:
    ctx = zmq.asyncio.Context()
    addresses = [f"inproc://encoder-{name}" for name in "abc"]
    encoders = [Encoder(ctx, address, {b"k": TOKENS}) for address in addresses]
    fetcher = EngineImages(ctx, capacity_bytes=0, timeout_s=5)  # no LRU: every request fetches
    try:
        for address in [*addresses, addresses[0]]:
            assert torch.equal((await fetcher.tensors([reference(b"k", address)]))[0], TOKENS)
        assert fetcher.encoder_addresses == [addresses[2], addresses[0]]  # a went for c, b for a's return
        assert [len(encoder.asked) for encoder in encoders] == [2, 1, 1]
    finally:
        for encoder in encoders:
            encoder.close()
        fetcher.close()
        ctx.destroy(linger=0)


def test_sockets_to_encoders_no_longer_asked_are_closed_past_a_bound(monkeypatch):
    monkeypatch.setattr("llm_engine.images.ENCODERS_REMEMBERED", 2)
    asyncio.run(_encoders_forgotten())


async def _a_shared_push_after_one_waiter_went_away() -> tuple[bool, list]:
    source = "inproc://encoder-shared-push"
    async with encoder_and_fetcher(source, {b"s": TOKENS * 5}, push_wait_s=30) as (encoder, fetcher):
        first = asyncio.create_task(fetcher.tensors([pushed_reference(b"s", source)]))
        second = asyncio.create_task(fetcher.tensors([pushed_reference(b"s", source)]))
        await wait_until_async(lambda: (b"s", b"id-s") in fetcher._awaited, 5, "the requests waiting for the push")
        await asyncio.sleep(0.1)  # both of them
        first.cancel()  # its gateway went away
        await asyncio.gather(first, return_exceptions=True)
        push(fetcher, b"s", TOKENS * 2)
        got = await asyncio.wait_for(second, 5)  # the push ends its wait, not push_wait_s (30 s)
        return torch.equal(got[0], TOKENS * 2), encoder.asked


def test_a_push_two_requests_wait_for_ends_the_other_s_wait_when_one_is_cancelled():
    assert asyncio.run(_a_shared_push_after_one_waiter_went_away()) == (True, [])
