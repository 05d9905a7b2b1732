"""A request's encoder stages (cache lookup, encode_queue, encode) add up to its time in the
encoder, however its batches went: shared, joined under way, or two that overlap."""

from __future__ import annotations

import pytest

from vision_encoder.work import PendingRequest, StageTimes, union_length


def request(arrived: float = 0.0, lookup: float = 0.0) -> PendingRequest:
    state = PendingRequest(b"gateway", "r", arrived, [None], [b"k"])
    state.cache_lookup_s = lookup
    return state


def test_spans_are_counted_once():
    assert union_length([(0, 1), (1, 3), (1, 2), (3, 5)]) == 5
    assert union_length([(4, 5), (0, 1)]) == 2 and union_length([]) == 0


def test_one_batch_waited_for_then_encoded():
    state = request(lookup=0.1)
    state.encoded_in(StageTimes(preprocess_start=1.0, preprocess_end=1.5, vit_start=2.0, vit_end=4.0))
    # queued 0.1→1.0, 1.5→2.0 and 4.0→4.2 (the loop's turn, the reply); busy 0.5 + 2.0
    assert state.encoder_stages(answered=4.2) == pytest.approx((1.6, 2.5))


def test_two_overlapping_batches_are_not_counted_twice():
    """Batch 1 busy 0→3 s and batch 2, pipelined beside it, 1→5 s: the request waited 5 s in all.
    Summing each batch's busy time and its own queue said 8 (unaccounted went negative)."""
    state = request()
    state.encoded_in(StageTimes(preprocess_start=0, preprocess_end=1, vit_start=1, vit_end=3))
    state.encoded_in(StageTimes(preprocess_start=1, preprocess_end=2, vit_start=3, vit_end=5))
    queue, encode = state.encoder_stages(answered=5.0)
    assert (queue, encode) == pytest.approx((0.0, 5.0))


def test_a_request_that_joined_a_batch_under_way_counts_from_its_cache_lookup_s_end():
    state = request(arrived=2.0, lookup=0.25)
    state.encoded_in(StageTimes(preprocess_start=0, preprocess_end=1, vit_start=1, vit_end=3))
    assert state.encoder_stages(answered=3.0) == pytest.approx((0.0, 0.75))  # 2.25→3.0, the lookup's time not twice


def test_a_request_answered_from_the_caches_spent_nothing_encoding():
    assert request(lookup=0.2).encoder_stages(answered=0.3) == (0.0, 0.0)
