"""The encoder's worker threads (vision_encoder/work.py, Lanes): with two ViT
threads two batches run at once and each is reported as it ends, in whatever
order; the loop hears of every end through the wake socket; threads after the
first run at the configured nice value; the batches in the ViT at once are
counted for the stats (AtOnce)."""

from __future__ import annotations

import os
import threading

import zmq

from vision_encoder.batcher import Job
from vision_encoder.work import AtOnce, Lanes, StageTimes

WAIT_S = 10


def job(name: str) -> list[Job]:
    return [Job(name.encode(), None, 1, 0.0)]


def wait_for_wake(lanes: Lanes) -> None:
    assert lanes.wake.poll(WAIT_S * 1000), "no wake-up from the lane"


def test_two_threads_run_two_batches_at_once_and_report_each_as_it_ends():
    lanes = Lanes(zmq.Context.instance(), "test-vit", threads=2)
    both_running = threading.Barrier(2, timeout=WAIT_S)  # breaks (an error) unless both batches run together
    release_first = threading.Event()

    def first():
        both_running.wait()
        assert release_first.wait(WAIT_S)
        return "first"

    def second():
        both_running.wait()
        return "second"

    a = lanes.submit(job("a"), StageTimes(), first)
    b = lanes.submit(job("b"), StageTimes(), second)
    wait_for_wake(lanes)
    assert lanes.finished() == [b]  # the later batch ended first: it is not held behind the earlier one
    assert b.future.result() == "second"
    assert lanes.batches == [a]
    release_first.set()
    wait_for_wake(lanes)
    assert lanes.finished() == [a]
    assert a.future.result() == "first" and lanes.batches == []


def test_one_thread_runs_batches_in_order():
    lanes = Lanes(zmq.Context.instance(), "test-one", threads=1)
    ran: list[str] = []
    batches = [lanes.submit(job(name), StageTimes(), lambda name=name: ran.append(name)) for name in "abc"]
    ended: list = []
    while len(ended) < 3:
        wait_for_wake(lanes)
        ended += lanes.finished()
    assert ran == ["a", "b", "c"] and ended == batches


def test_threads_after_the_first_run_at_the_extra_nice_value():
    lanes = Lanes(zmq.Context.instance(), "test-nice", threads=2, extra_nice=7)
    both_running = threading.Barrier(2, timeout=WAIT_S)
    base = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's

    def own_nice():
        both_running.wait()  # two batches at once: one on each thread
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - base

    batches = [lanes.submit(job(name), StageTimes(), own_nice) for name in "ab"]
    assert sorted(batch.future.result(WAIT_S) for batch in batches) == [0, 7]


def test_batches_in_the_vit_at_once_are_counted_now_and_at_most():
    in_vit = AtOnce()
    both_inside = threading.Barrier(3, timeout=WAIT_S)  # two batches and this test
    leave = threading.Event()

    def batch():
        with in_vit.inside():
            both_inside.wait()
            assert leave.wait(WAIT_S)

    threads = [threading.Thread(target=batch) for _ in range(2)]
    for thread in threads:
        thread.start()
    both_inside.wait()
    assert (in_vit.now, in_vit.most) == (2, 2)
    leave.set()
    for thread in threads:
        thread.join(WAIT_S)
    assert (in_vit.now, in_vit.most) == (0, 2)  # the most is kept: a stats poll between batches still sees it
    with in_vit.inside():
        assert (in_vit.now, in_vit.most) == (1, 2)


def test_a_batch_waiting_for_a_thread_has_not_started():
    """The stall watch judges a batch from `started`: one queued behind a long batch on the lane's
    only thread is not running, and its wait is not its own (it was declared stalled for it)."""
    lanes = Lanes(zmq.Context.instance(), "test-started", threads=1)
    taken, release = threading.Event(), threading.Event()

    def long():
        taken.set()
        return release.wait(WAIT_S)

    running = lanes.submit(job("long"), StageTimes(), long)
    queued = lanes.submit(job("next"), StageTimes(), lambda: "next")
    try:
        assert taken.wait(WAIT_S)
        assert not queued.future.done() and queued.started is None and running.started is not None
    finally:
        release.set()
    assert queued.future.result(WAIT_S) == "next" and queued.started >= running.started
