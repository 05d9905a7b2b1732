"""A field the request leaves out takes the checkpoint's generation_config.json
default, then OpenAI's; a field it sends wins (vLLM's server's order)."""

import msgspec
from vllm.sampling_params import RequestOutputKind

from llm_engine.requests import read_chat, sampling_params

def chat(**fields):
    return read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **fields}))


QWEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_the_checkpoint_defaults_fill_what_the_request_left_out():
    params = sampling_params(chat(max_tokens=8), 8, QWEN_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (0.0, 0.0, 0.0)


def test_the_request_wins_over_the_checkpoint():
    params = sampling_params(chat(max_tokens=8, temperature=0.5, top_p=0.5, presence_penalty=0.3), 8, QWEN_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k, params.presence_penalty) == (0.5, 0.5, 20, 0.3)


def test_without_checkpoint_defaults_openai_s_apply():
    params = sampling_params(chat(max_tokens=8), 8, {})
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_the_engine_always_streams_deltas_to_the_gateway():
    # A non-streamed answer is assembled by the gateway; vLLM would otherwise hold it to the end.
    assert sampling_params(chat(max_tokens=8, stream=False), 8, {}).output_kind == RequestOutputKind.DELTA
