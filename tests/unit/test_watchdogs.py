"""The stall rules of the engine's and the encoder's watchdogs."""

from llm_engine.watchdog import StallWatch, Verdict
from vision_encoder.watchdog import BatchWatch


def test_an_idle_engine_is_never_stalled_and_work_arriving_starts_the_clock():
    watch = StallWatch(stall_timeout_s=3, restart_after_s=10)
    watch.note_step(0)
    assert watch.check(100, busy=False) is Verdict.OK  # nothing to do for 100 s: not a stall
    watch.note_work_arrived(100, was_idle=True)
    assert watch.check(102, busy=True) is Verdict.OK
    assert watch.check(103.5, busy=True) is Verdict.STALLED
    assert watch.check(104, busy=True) is Verdict.STILL_STALLED and watch.stalls == 1


def test_work_arriving_at_a_busy_engine_does_not_reset_the_clock():
    watch = StallWatch(stall_timeout_s=3, restart_after_s=10)
    watch.note_work_arrived(0, was_idle=True)
    watch.note_work_arrived(2.5, was_idle=False)
    assert watch.check(3.5, busy=True) is Verdict.STALLED


def test_a_step_or_an_answer_ends_a_stall_and_a_long_one_asks_for_a_restart():
    watch = StallWatch(stall_timeout_s=3, restart_after_s=10)
    watch.note_work_arrived(0, was_idle=True)
    assert watch.check(4, busy=True) is Verdict.STALLED
    watch.note_step(5)
    assert not watch.stalled and watch.check(6, busy=True) is Verdict.OK
    assert watch.check(9, busy=True) is Verdict.STALLED
    watch.recovered(10)
    assert watch.check(11, busy=False) is Verdict.OK
    assert watch.check(14, busy=True) is Verdict.STALLED
    assert watch.check(23, busy=False) is Verdict.STILL_STALLED  # stalled whether or not requests remain
    assert watch.check(24, busy=False) is Verdict.RESTART


def test_a_batch_is_judged_by_its_patch_count_never_before_the_minimum():
    watch = BatchWatch(factor=10, min_s=2, restart_after_s=30)
    assert watch.limit_s(10_000) == 2  # nothing learnt yet: only the floor
    watch.finished(patches=1000, busy_s=60.0, started=-9)  # the first batch: its warm-up teaches nothing
    assert watch.limit_s(10_000) == 2
    watch.finished(patches=1000, busy_s=1.0, started=-5)  # 1 ms a patch
    assert watch.limit_s(100) == 2 and watch.limit_s(1000) == 10
    assert not watch.newly_stalled(now=9, oldest_started=0, patches=1000)
    assert watch.newly_stalled(now=11, oldest_started=0, patches=1000)
    assert not watch.newly_stalled(now=12, oldest_started=0, patches=1000)  # once
    assert watch.stalls == 1 and not watch.should_restart(40) and watch.should_restart(41)
    watch.finished(patches=10, busy_s=0.01, started=10.5)  # another lane's batch: the stall goes on
    assert watch.stalled and watch.should_restart(41)
    learnt = watch.seconds_per_patch
    watch.finished(patches=1000, busy_s=20.0, started=0)  # the stalled one came back, slowly: over, and nothing learnt of it
    assert not watch.stalled and watch.seconds_per_patch == learnt


def test_a_batch_far_slower_than_the_average_moves_it_a_little():
    """One 100 s batch used to raise the limit some thirteen times over, and a hang after it went unseen for minutes."""
    watch = BatchWatch(factor=10, min_s=2, restart_after_s=30)
    for started in range(21):
        watch.finished(patches=16384, busy_s=0.2, started=started)
    before = watch.limit_s(16384)
    watch.finished(patches=16384, busy_s=100, started=30)
    assert watch.limit_s(16384) < 2 * before


def test_no_running_batch_is_no_stall():
    assert not BatchWatch(factor=10, min_s=2, restart_after_s=30).newly_stalled(now=100, oldest_started=None, patches=0)
