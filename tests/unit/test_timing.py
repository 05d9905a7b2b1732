"""A request's time per output token: per choice, as its tokens are made."""

from __future__ import annotations

import pytest

from gateway.timing import RequestTimer


@pytest.mark.parametrize("choices,completion_tokens,tpot", [(1, 11, 0.1), (2, 22, 0.1), (4, 4, None)])
def test_time_per_output_token_counts_each_choice_s_tokens(choices, completion_tokens, tpot):
    """usage's completion_tokens adds every choice's: with n = 2, 22 tokens are 11 steps of two."""
    timer = RequestTimer(first_token_at=0.0, finished_at=1.0, completion_tokens=completion_tokens, choices=choices)
    assert timer.tpot_s == pytest.approx(tpot) if tpot is not None else timer.tpot_s is None
