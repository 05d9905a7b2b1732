"""A request's time per output token: per decode step, as its tokens are made."""

from __future__ import annotations

import pytest

from gateway.timing import RequestTimer
from protocol.to_gateway import ChoiceDelta, TokenDelta


@pytest.mark.parametrize("choices,completion_tokens,tpot", [(1, 11, 0.1), (2, 22, 0.1), (4, 4, None)])
def test_time_per_output_token_counts_each_choice_s_tokens(choices, completion_tokens, tpot):
    """usage's completion_tokens adds every choice's: with n = 2, 22 tokens are 11 steps of two
    (an engine that does not count per choice: the mean choice's)."""
    timer = RequestTimer(first_token_at=0.0, finished_at=1.0, completion_tokens=completion_tokens, choices=choices)
    assert timer.tpot_s == pytest.approx(tpot) if tpot is not None else timer.tpot_s is None


def test_choices_of_unequal_length_take_as_many_steps_as_the_longest():
    """n = 2, one choice stops after 1 token and the other makes 11: the request decoded for
    11 steps (10 after the first token), not for the mean choice's 6."""
    timer = RequestTimer(first_token_at=0.0, choices=2)
    timer.mark_delta(TokenDelta("r", [ChoiceDelta(0, tokens=1, finish_reason="stop"), ChoiceDelta(1, tokens=1)], 2, 5))
    timer.mark_delta(TokenDelta("r", [ChoiceDelta(1, tokens=10, finish_reason="length")], 12, 5, finished=True))
    timer.finished_at = 1.0
    assert timer.choice_tokens == {0: 1, 1: 11}
    assert timer.tpot_s == pytest.approx(0.1)


def test_a_request_s_visual_tokens_are_observed_whether_images_or_videos_made_them():
    from gateway.ops import metrics

    def requests_observed() -> float:
        return next(s.value for s in metrics.VISUAL_TOKENS.collect()[0].samples if s.name.endswith("_count"))

    before = requests_observed()
    for image_sizes, visual_tokens in (([(640, 480)], 300), ([], 1200), ([], 0)):  # images; a video alone; text
        timer = RequestTimer()
        timer.image_sizes, timer.visual_tokens = image_sizes, visual_tokens
        metrics.observe(timer, ok=True)
    assert requests_observed() == before + 2


def test_stage_histograms_take_a_stage_where_it_ran_and_their_means_add_up_to_the_ttft():
    """An image request and a video request: video_decode is observed once (a p95 of its own, not
    of the image request's 0), unaccounted twice; each stage's sum over unaccounted's count is its
    mean share, and those shares add up to the mean TTFT (configs/grafana's stacked panel)."""
    from gateway.ops import metrics
    from gateway.timing import STAGES

    def totals() -> dict[tuple[str, str], float]:
        return {(s.labels["stage"], s.name.rsplit("_", 1)[1]): s.value for s in metrics.STAGE_SECONDS.collect()[0].samples
                if s.name.endswith(("_sum", "_count"))}

    before = totals()
    assert {stage for stage, _ in before} == set(STAGES)  # every stage exported before it runs
    ttfts = []
    for stages in ({"parse": 0.01, "image_preprocess": 0.1, "prefill": 0.3}, {"parse": 0.01, "video_decode": 2.0, "prefill": 0.5}):
        timer = RequestTimer(arrived=0.0)
        for stage, seconds in stages.items():
            timer.add(stage, seconds)
        timer.first_token_at = sum(stages.values()) + 0.05
        ttfts.append(timer.ttft_s)
        metrics.observe(timer, ok=True)
    after = totals()
    grew = {key: after[key] - before[key] for key in after}
    assert grew["video_decode", "count"] == 1 and grew["image_preprocess", "count"] == 1 and grew["encode", "count"] == 0
    assert grew["parse", "count"] == grew["unaccounted", "count"] == 2
    means = {stage: grew[stage, "sum"] / grew["unaccounted", "count"] for stage in STAGES}
    assert sum(means.values()) == pytest.approx(sum(ttfts) / 2)


def deltas_at(monkeypatch, timer: RequestTimer, deltas: list[tuple[float, TokenDelta]]) -> None:
    """Each delta marked as arriving at its time."""
    for at, delta in deltas:
        monkeypatch.setattr("gateway.timing.time.perf_counter", lambda at=at: at)
        timer.mark_delta(delta)


def test_a_delta_of_several_tokens_spreads_its_gap_over_them(monkeypatch):
    """vLLM merges deltas while their reader lags, and `stream_interval` sends every so many steps:
    one gap a delta counted a delta's gap as one token's (fewer, longer inter-token latencies)."""
    timer = RequestTimer(first_token_at=0.0)
    deltas_at(monkeypatch, timer, [(0.0, TokenDelta("r", [ChoiceDelta(0, tokens=1)], 1, 5)),
                                   (0.4, TokenDelta("r", [ChoiceDelta(0, tokens=4)], 5, 5)),
                                   (0.6, TokenDelta("r", [ChoiceDelta(0, tokens=4)], 9, 5)),
                                   (0.7, TokenDelta("r", [ChoiceDelta(0, tokens=0)], 9, 5, finished=True))])  # an end, no token
    timer.finished_at = 1.0
    assert timer.inter_token_gaps() == pytest.approx([0.1] * 4 + [0.05] * 4)  # 8 tokens after the first
    assert timer.tpot_s == pytest.approx(0.125)


def test_the_choices_of_a_stream_of_n_each_have_their_own_gaps(monkeypatch):
    """With n > 1 each choice's token comes in a delta of its own, microseconds after the other's:
    gaps between consecutive deltas were mostly those microseconds (a median near 0)."""
    timer = RequestTimer(first_token_at=0.0)
    deltas_at(monkeypatch, timer, [(step * 0.1 + index * 1e-6, TokenDelta("r", [ChoiceDelta(index, tokens=1)], 2 * step + index + 1, 5))
                                   for step in range(4) for index in (0, 1)])
    assert timer.inter_token_gaps() == pytest.approx([0.1] * 6)  # 3 gaps each


def test_latency_buckets_step_by_at_most_half_again_from_ten_ms_to_ten_s():
    """histogram_quantile interpolates linearly inside a bucket: with 0.25 and 0.5 s as neighbours,
    TTFTs spread over 0.26-0.30 s read as a p95 of 0.49 s. Where GPU and CPU stages and TTFTs fall,
    a quantile errs by at most the step."""
    from gateway.ops.metrics import LATENCY_BUCKETS

    within = [b for b in LATENCY_BUCKETS if 0.01 <= b <= 10]
    assert within[0] == 0.01 and within[-1] == 10
    assert all(upper / lower <= 1.5 for lower, upper in zip(within, within[1:])), within
