"""vLLM's sampling knobs through the chat API (the openai SDK's `extra_body`
for the ones OpenAI lacks): each changes the answer as it says, and a value
out of range is refused naming the field."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from prism.demo_model import RANDOM_MODEL
from tests.integration.conftest import MODEL_NAME

PROMPT = [{"role": "user", "content": "Describe a red circle."}]


def answer(client, **kwargs):
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("temperature", "seed", "max_tokens", "logit_bias", "stop")}
    params = {"temperature": 0, "max_tokens": 12} | kwargs
    return client.chat.completions.create(model=MODEL_NAME, messages=PROMPT, extra_body=extra, **params).choices[0]


@pytest.fixture(scope="module")
def first_token(client) -> int:
    """The id of the greedy answer's first token."""
    text = answer(client, max_tokens=1).message.content
    ids = AutoTokenizer.from_pretrained(RANDOM_MODEL).encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_top_k_one_makes_sampling_greedy_whatever_the_seed(client):
    sampled = {answer(client, temperature=1.0, seed=seed).message.content for seed in (1, 2, 3)}
    assert len(sampled) > 1  # without top_k the seed matters...
    assert len({answer(client, temperature=1.0, seed=seed, top_k=1).message.content for seed in (1, 2, 3)}) == 1  # ...with it, not


def test_logit_bias_bans_a_token(client, first_token):
    assert answer(client, max_tokens=1).message.content != answer(client, max_tokens=1, logit_bias={str(first_token): -100}).message.content


def test_stop_token_ids_end_the_answer_at_that_token(client, first_token):
    stopped = answer(client, stop_token_ids=[first_token])
    assert stopped.finish_reason == "stop" and stopped.message.content == ""  # vLLM leaves the stop token's text out
    assert answer(client).finish_reason == "length"


def test_include_stop_str_in_output(client):
    full = answer(client).message.content
    stop = next(full[i:i + 2] for i in range(1, len(full) - 2) if full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i)
    cut = full.index(stop)
    assert answer(client, stop=[stop]).message.content == full[:cut]
    assert answer(client, stop=[stop], include_stop_str_in_output=True).message.content == full[:cut + len(stop)]


def test_repetition_penalty_and_min_p_change_the_answer(client):
    greedy = answer(client).message.content
    assert answer(client, repetition_penalty=2.0).message.content != greedy
    assert answer(client, temperature=1.0, seed=4, min_p=1.0).message.content == greedy  # only the likeliest token stays


@pytest.mark.parametrize("field,value", [("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0), ("logit_bias", {"x": 1})])
def test_values_out_of_range_are_refused_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError, match=field):
        answer(client, **{field: value})


def test_a_bias_past_100_is_held_to_it_as_vllm_s_server_holds_it(client, first_token):
    banned = answer(client, max_tokens=1, logit_bias={str(first_token): -100}).message.content
    assert answer(client, max_tokens=1, logit_bias={str(first_token): -1000}).message.content == banned
    assert banned != answer(client, max_tokens=1).message.content


def test_a_token_id_outside_the_vocabulary_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="out-of-vocab"):
        answer(client, logit_bias={"999999": 5})
