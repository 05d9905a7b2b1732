"""Parity with vLLM's reference: equal, or equal up to a token vLLM itself nearly tied on."""

from tests.integration.cases import TIE_LOGPROB, matches_reference

EXPECTED = {"text": "_ image image", "prefixes": ["_", "_ image", "_ image image"], "margins": [0.05, 0.02, TIE_LOGPROB / 10]}


def test_the_same_answer_matches():
    assert matches_reference("_ image image", EXPECTED)


def test_an_answer_that_parts_where_vllm_tied_matches():
    assert matches_reference("_ image wh", EXPECTED)


def test_an_answer_that_parts_where_vllm_was_sure_does_not():
    assert not matches_reference("_ many image", EXPECTED)
    assert not matches_reference("_", EXPECTED)  # stopped early
    assert not matches_reference("_ image image image", EXPECTED)  # ran on
