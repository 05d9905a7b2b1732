"""Encoder batching: image cap, patch budget, maximum wait, dedup."""

from __future__ import annotations

import time

import pytest

from vision_encoder.batcher import Batcher


def test_batch_closes_at_the_image_cap():
    b = Batcher(max_images=2, max_patches=10**6, max_wait_s=60)
    b.add(b"a", None, 10, ("r1", 0))
    assert b.seconds_until_due(time.monotonic()) > 0
    b.add(b"b", None, 10, ("r1", 1))
    assert b.seconds_until_due(time.monotonic()) == 0
    assert [j.key for j in b.take()] == [b"a", b"b"]


def test_patch_budget_splits_batches_but_never_starves_a_big_image():
    b = Batcher(max_images=16, max_patches=100, max_wait_s=0)
    b.add(b"big", None, 500, ("r1", 0))
    b.add(b"s1", None, 60, ("r2", 0))
    b.add(b"s2", None, 60, ("r3", 0))
    assert [j.key for j in b.take()] == [b"big"]  # alone, over budget, still encoded
    assert [j.key for j in b.take()] == [b"s1"]
    assert [j.key for j in b.take()] == [b"s2"]


def test_max_wait_makes_a_partial_batch_due():
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=0.01)
    b.add(b"a", None, 1, ("r", 0))
    arrived = next(iter(b._queue.values())).arrived  # times from its own arrival: no pause of the test's counts
    assert b.seconds_until_due(arrived) == pytest.approx(0.01)
    assert b.seconds_until_due(arrived + 0.02) == 0


def test_same_key_joins_the_waiting_job():
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=0)
    b.add(b"k", None, 1, ("r1", 0))
    b.add(b"k", None, 1, ("r2", 3))
    assert b.join(b"k", ("r3", 1)) and b.join(b"k", ("r3", 1), record=False)  # a retry's second round: counted once
    (job,) = b.take()
    assert job.waiters == [("r1", 0), ("r2", 3), ("r3", 1), ("r3", 1)] and b.joins == 2


def test_cancel_drops_jobs_nobody_waits_for():
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=0)
    b.add(b"shared", None, 1, ("r1", 0))
    b.add(b"shared", None, 1, ("r2", 0))
    b.add(b"mine", None, 1, ("r1", 1))
    b.drop_waiters("r1")
    (job,) = b.take()
    assert job.key == b"shared" and job.waiters == [("r2", 0)]


def test_jobs_with_colliding_keys_but_different_images_stay_apart():
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=0)
    b.add(b"k", "pixels-A", 1, ("r1", 0), identity=b"A")
    b.add(b"k", "pixels-B", 1, ("r2", 0), identity=b"B")
    jobs = b.take()
    assert [(j.key, j.image) for j in jobs] == [(b"k", "pixels-A"), (b"k", "pixels-B")] and b.joins == 0


def test_a_small_image_never_rides_in_a_large_images_batch():
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=0, size_ratio=4, age_limit_s=60)
    b.add(b"4k-1", None, 5000, ("r1", 0))
    b.add(b"256-1", None, 324, ("r2", 0))
    b.add(b"1080p", None, 4600, ("r3", 0))
    b.add(b"256-2", None, 400, ("r4", 0))
    assert [j.key for j in b.take()] == [b"256-1", b"256-2"]  # the small ones first, together
    assert [j.key for j in b.take()] == [b"1080p", b"4k-1"]  # then the large ones, smallest first


def test_an_image_waiting_past_the_age_limit_leads_whatever_its_size():
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=0, size_ratio=4, age_limit_s=0.05)
    b.add(b"4k", None, 5000, ("r1", 0))
    b.add(b"small", None, 324, ("r2", 0))
    time.sleep(0.06)  # time passing is what is tested: the 4k image ages past the limit
    assert [j.key for j in b.take()] == [b"4k"]  # aged: it goes, and the small one is not dragged along
    assert [j.key for j in b.take()] == [b"small"]


def test_size_classes_keep_the_budgets():
    b = Batcher(max_images=2, max_patches=700, max_wait_s=0, size_ratio=4, age_limit_s=60)
    for i, patches in enumerate([300, 310, 320, 330]):
        b.add(bytes([i]), None, patches, ("r", i))
    assert [j.patches for j in b.take()] == [300, 310]
    assert [j.patches for j in b.take()] == [320, 330]


def test_the_express_lane_takes_only_small_images_oldest_first():
    b = Batcher(max_images=2, max_patches=10**6, max_wait_s=0, size_ratio=4, age_limit_s=60)
    b.add(b"4k", None, 5000, ("r1", 0))
    assert b.take(1024) == []  # nothing small waiting: the large image stays for the main lane
    b.add(b"256-1", None, 324, ("r2", 0))
    b.add(b"448", None, 1024, ("r3", 0))
    b.add(b"256-2", None, 324, ("r4", 0))
    assert [j.key for j in b.take(1024)] == [b"256-1", b"448"]  # at most max_images, by arrival
    assert [j.key for j in b.take(1024)] == [b"256-2"]
    assert [j.key for j in b.take()] == [b"4k"]


def test_the_queue_counts_the_bytes_its_waiting_jobs_hold():
    """A job's bytes once however many wait on it, given back when its batch is taken or nobody waits."""
    b = Batcher(max_images=1, max_patches=10**6, max_wait_s=0)
    b.add(b"a", None, 1, ("r1", 0), nbytes=100)
    b.add(b"a", None, 1, ("r2", 0), nbytes=100)  # joins a
    b.add(b"b", None, 1, ("r1", 1), nbytes=30)
    assert b.queued_bytes == 130
    b.take()
    assert b.queued_bytes == 30
    b.drop_waiters("r1")
    assert b.queued_bytes == 0 and len(b) == 0


@pytest.mark.parametrize("max_job_patches", [None, 1024], ids=["main-lane", "express-lane"])
def test_more_urgent_jobs_go_first_then_by_arrival(max_job_patches):
    """vLLM's `priority`: lower first, arrival breaking ties."""
    b = Batcher(max_images=2, max_patches=10**6, max_wait_s=0)
    b.add(b"late-1", None, 324, ("r1", 0), priority=1)
    b.add(b"usual", None, 324, ("r2", 0))
    b.add(b"late-2", None, 324, ("r3", 0), priority=1)
    b.add(b"urgent", None, 324, ("r4", 0), priority=-3)
    assert [j.key for j in b.take(max_job_patches)] == [b"urgent", b"usual"]
    assert [j.key for j in b.take(max_job_patches)] == [b"late-1", b"late-2"]


def test_a_more_urgent_request_joining_a_job_makes_it_as_urgent():
    b = Batcher(max_images=1, max_patches=10**6, max_wait_s=0)
    b.add(b"first", None, 1, ("r1", 0))
    b.add(b"shared", None, 1, ("r2", 0), priority=2)
    assert b.join(b"shared", ("r3", 0), priority=-1)
    b.add(b"shared", None, 1, ("r4", 0), priority=5)  # a less urgent one leaves it as urgent
    assert [j.key for j in b.take()] == [b"shared"] and [j.key for j in b.take()] == [b"first"]


def test_with_size_classes_the_most_urgent_class_leads_and_the_rest_fill_by_urgency():
    b = Batcher(max_images=3, max_patches=10**6, max_wait_s=0, size_ratio=4, age_limit_s=60)
    b.add(b"256-usual", None, 324, ("r1", 0))
    b.add(b"1080p-urgent", None, 4600, ("r2", 0), priority=-1)
    b.add(b"4k-late", None, 5000, ("r3", 0), priority=1)
    b.add(b"4k-usual", None, 5000, ("r4", 0))
    assert [j.key for j in b.take()] == [b"1080p-urgent", b"4k-usual", b"4k-late"]  # its class, most urgent first
    assert [j.key for j in b.take()] == [b"256-usual"]


def test_a_job_ranks_again_as_its_waiters_left_once_the_urgent_one_leaves():
    b = Batcher(max_images=1, max_patches=10**6, max_wait_s=0)
    b.add(b"later", None, 1, ("r1", 0), priority=5)
    b.add(b"usual", None, 1, ("r2", 0))
    assert b.join(b"later", ("urgent", 0), priority=-9)
    b.drop_waiters("urgent")  # cancelled, refused, or gone to another replica
    assert [j.key for j in b.take()] == [b"usual"] and [j.key for j in b.take()] == [b"later"]


def test_an_urgent_join_ranks_a_job_from_when_it_joined_not_from_when_the_job_came():
    """A long-queued 4K image joined by an urgent request is that request's age in the urgent class:
    it does not lead it as aged ahead of an urgent image that came before the join."""
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=0, size_ratio=4, age_limit_s=0.05)
    b.add(b"4k-old", None, 5000, ("r1", 0))
    time.sleep(0.06)  # time passing is what is tested: the 4K image is past the age limit
    b.add(b"small-urgent", None, 324, ("r2", 0), priority=-1)
    assert b.join(b"4k-old", ("r3", 0), priority=-1)
    assert [j.key for j in b.take()] == [b"small-urgent"]
    assert [j.key for j in b.take()] == [b"4k-old"]


def test_a_less_urgent_job_past_its_wait_leaves_the_urgent_ones_their_batching_window():
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=0.05)
    b.add(b"starved", None, 1, ("r1", 0), priority=5)
    time.sleep(0.06)  # time passing is what is tested: the starved job is past max_wait
    b.add(b"urgent", None, 1, ("r2", 0), priority=-1)
    (urgent,) = [job for job in b._queue.values() if job.key == b"urgent"]
    assert b.seconds_until_due(urgent.rank[1]) == pytest.approx(0.05)


def test_the_jobs_less_urgent_than_a_priority_are_those_all_of_whose_waiters_are_least_urgent_and_latest_first():
    """What the encoder's full queue gives up for a more urgent request (vision_encoder/service.py)."""
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=60)
    b.add(b"early", None, 1, ("r1", 0), priority=3)
    b.add(b"shared", None, 1, ("r2", 0), priority=5)
    b.join(b"shared", ("r3", 0), priority=-2)  # a waiter as urgent as the newcomer keeps it
    b.add(b"late", None, 1, ("r4", 0), priority=3)
    b.add(b"least", None, 1, ("r5", 0), priority=7)
    b.add(b"as-urgent", None, 1, ("r6", 0), priority=-2)
    assert [job.key for job in b.less_urgent(-2)] == [b"least", b"late", b"early"]
    assert b.less_urgent(7) == []


def past_half_of(bound: int, adding: int):
    """vision_encoder/service.py's rule, as `giving_way`'s `fits`: the queue left takes `adding` more items."""
    return lambda jobs, _held: not (2 * jobs >= bound and jobs + adding > bound)


def test_the_fewest_less_urgent_requests_that_free_enough_give_way():
    """A request leaves whole: the early request of five images frees enough alone, where taking the
    later one-image requests first would refuse four."""
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=60)
    for i in range(5):
        b.add(b"x%d" % i, None, 1, ("x", i), priority=5)
    for name in ("y1", "y2", "y3"):
        b.add(name.encode(), None, 1, (name, 0), priority=5)
    assert b.giving_way(-1, past_half_of(8, 4)) == ["x"]
    assert b.giving_way(-1, past_half_of(8, 2)) == ["y3", "y2"]  # enough from the latest, least urgent
    assert b.giving_way(5, past_half_of(8, 4)) is None  # none less urgent
    b.add(b"as-urgent", None, 1, ("u", 0), priority=-1)
    assert b.giving_way(-1, past_half_of(2, 2)) is None  # all of it would leave the as-urgent job, half the bound: nobody gives way


def test_a_job_a_more_urgent_request_waits_on_frees_nothing_when_its_other_waiters_give_way():
    b = Batcher(max_images=16, max_patches=10**6, max_wait_s=60)
    b.add(b"shared", None, 1, ("z", 0), priority=5)
    b.join(b"shared", ("urgent-waiter", 0), priority=-3)
    b.add(b"own", None, 1, ("z", 1), priority=5)
    assert b.giving_way(-1, past_half_of(2, 1)) == ["z"]  # its own job alone goes: 1 left
    assert b.giving_way(-1, past_half_of(0, 2)) is None  # the shared job stays whoever leaves
