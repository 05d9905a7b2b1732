"""The same requests to Prism and to vLLM's own OpenAI server on the same
checkpoint (float32, the same pixel budget, the same tool parser and
structured-output backend): structured outputs, tool calls, logprobs and
seeded choices come back the same.

vLLM's server runs the vision tower on the raw image itself; Prism's encoder
service does it and hands vLLM the embeddings."""

from __future__ import annotations

import json
import subprocess

import openai
import pytest
from openai import OpenAI

from bench.servers import launch_vllm_server
from common.supervisor import stop_group
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import wait_for_health
from tests.integration.cases import TEST_MAX_PIXELS, TEST_MIN_PIXELS
from tests.integration.conftest import MODEL_NAME, session_stack
from tests.integration.chat_requests import QUESTION, SCENE_SCHEMA, TIME, WEATHER, image_part, loose

# What configs/cpu-demo.yaml sets for the engine, said to vLLM's server.
SERVER_FLAGS = (
    "--mm-processor-kwargs", json.dumps({"max_pixels": TEST_MAX_PIXELS, "min_pixels": TEST_MIN_PIXELS}),
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
    # The model in vLLM's engine core, as the module stacks run it (conftest.ONE_PROCESS_ENGINE): a
    # process fewer to start; vLLM's CPU platform keeps "uni" only with multiprocessing off.
    "--distributed-executor-backend", "uni",
)
SERVER_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0",  # engine.strict_tool_calling: false
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


_SERVER = pytest.StashKey[tuple[subprocess.Popen, str]]()


def launched_server(config: pytest.Config) -> tuple[subprocess.Popen, str]:
    """vLLM's server, launched once (the process, its base URL)."""
    if _SERVER not in config.stash:
        ensure_demo_model(RANDOM_MODEL)
        log = session_stack(config).tmp.mktemp("vllm-server") / "server.log"
        config.stash[_SERVER] = process, _ = launch_vllm_server(RANDOM_MODEL, MODEL_NAME, TEST_MAX_PIXELS, log, max_images=4,
                                                                dtype="float32", extra=SERVER_FLAGS, env=SERVER_ENV)
        config.add_cleanup(lambda: stop_group(process, grace_s=60))  # vLLM's engine core is in its group
    return config.stash[_SERVER]


def prestart(config: pytest.Config, items: list[pytest.Item]) -> None:
    """vLLM's server starts while the unit tests run (tests/integration/prestart.py)."""
    launched_server(config)


@pytest.fixture(scope="module")
def vllm(stack, pytestconfig) -> OpenAI:
    process, base_url = launched_server(pytestconfig)
    wait_for_health(base_url, process, 600)
    yield OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    stop_group(process, grace_s=60)  # its memory back for the modules after this one


def both(client: OpenAI, vllm: OpenAI, **fields):
    fields.setdefault("messages", QUESTION)
    fields.setdefault("temperature", 0)
    return [c.chat.completions.create(model=MODEL_NAME, **fields) for c in (client, vllm)]


def test_json_schema_output_is_byte_identical(client, vllm, images):
    messages = [{"role": "user", "content": [image_part(images), {"type": "text", "text": "What is it?"}]}]
    fmt = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCENE_SCHEMA, "strict": True}}
    prism, reference = both(client, vllm, messages=messages, max_tokens=40, response_format=fmt)
    assert prism.choices[0].message.content == reference.choices[0].message.content
    assert prism.usage.prompt_tokens == reference.usage.prompt_tokens


def calls(response) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"])
def test_forced_tool_calls_are_identical(client, vllm, tool_choice):
    prism, reference = both(client, vllm, max_tokens=120, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert calls(prism) and calls(prism) == calls(reference)
    assert prism.choices[0].finish_reason == reference.choices[0].finish_reason
    assert prism.choices[0].message.content == reference.choices[0].message.content  # "" beside a forced call
    assert prism.usage.prompt_tokens == reference.usage.prompt_tokens  # the same prompt, tools rendered alike


def test_a_call_cut_off_after_it_closed_finishes_alike(client, vllm):
    """Auto mode, non-streamed: a whole call and then text up to max_tokens."""
    markup = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Rome"\}\}\n</tool_call>( [a-z]+)+'
    prism, reference = both(client, vllm, max_tokens=160, tools=[loose(WEATHER)], extra_body={"structured_outputs": {"regex": markup}})
    assert calls(prism) == calls(reference) and reference.choices[0].finish_reason == "tool_calls"
    assert prism.choices[0].finish_reason == reference.choices[0].finish_reason


def test_stop_reason_and_developer_messages_as_vllm(client, vllm):
    """A developer message mid-conversation is merged into the system prompt when the
    template has no such role; the stop string that ended an answer is its stop_reason."""
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION, {"role": "developer", "content": "Answer in one word."}]
    prism, reference = both(client, vllm, messages=messages, max_tokens=40, extra_body={"structured_outputs": {"regex": "red end blue"}},
                            stop=[" end"])
    assert prism.usage.prompt_tokens == reference.usage.prompt_tokens
    assert prism.choices[0].message.content == reference.choices[0].message.content == "red"
    assert prism.choices[0].model_extra["stop_reason"] == reference.choices[0].model_extra["stop_reason"] == " end"


def test_streamed_chunks_are_shaped_alike(client, vllm):
    """Each choice's role comes alone in its first chunk, before any token."""
    def shape(c):
        return list(c.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=5, n=2, seed=7, temperature=1.0, stream=True))

    def fields(chunks):
        return [(c.choices[0].index, c.choices[0].delta.role, c.choices[0].delta.content, c.choices[0].finish_reason,
                 (c.choices[0].model_extra or {}).get("stop_reason")) for c in chunks if c.choices]
    def by_choice(chunks):
        """Each choice's role chunk, its text, and its last chunk: how its tokens are cut into chunks, and
        how the two choices' chunks interleave, is timing (tokens that arrive together go out together,
        on either server)."""
        shaped = {}
        for index in (0, 1):
            own = [f for f in fields(chunks) if f[0] == index]
            shaped[index] = (own[0], "".join(f[2] or "" for f in own[1:]), own[-1][3:])  # role, text, finish and stop reason
        return shaped
    prism, reference = shape(client), shape(vllm)
    assert fields(prism)[:2] == fields(reference)[:2] == [(0, "assistant", "", None, None), (1, "assistant", "", None, None)]
    assert by_choice(prism) == by_choice(reference)


def test_auto_tool_calls_are_parsed_alike(client, vllm):
    markup = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
    prism, reference = both(client, vllm, max_tokens=120, tools=[loose(WEATHER)], extra_body={"structured_outputs": {"regex": markup}})
    assert calls(prism) and calls(prism) == calls(reference)
    assert prism.choices[0].message.content == reference.choices[0].message.content


def test_a_tool_result_in_the_history_gives_the_same_answer(client, vllm, images):
    history = [
        {"role": "user", "content": [image_part(images), {"type": "text", "text": "Weather here?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 24 C"},
    ]
    prism, reference = both(client, vllm, messages=history, max_tokens=8, tools=[loose(WEATHER)])
    assert prism.choices[0].message.content == reference.choices[0].message.content
    assert prism.usage.prompt_tokens == reference.usage.prompt_tokens


def test_logprobs_agree_within_1e_3(client, vllm, images):
    messages = [{"role": "user", "content": [image_part(images), {"type": "text", "text": "Describe it."}]}]
    prism, reference = both(client, vllm, messages=messages, max_tokens=6, logprobs=True, top_logprobs=5)
    ours, theirs = prism.choices[0].logprobs.content, reference.choices[0].logprobs.content
    assert [t.token for t in ours] == [t.token for t in theirs]
    for a, b in zip(ours, theirs):
        assert abs(a.logprob - b.logprob) < 1e-3
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(a.top_logprobs, b.top_logprobs))


def test_seeded_choices_are_identical(client, vllm):
    prism, reference = both(client, vllm, max_tokens=8, n=2, seed=1234, temperature=1.0)
    assert [c.message.content for c in prism.choices] == [c.message.content for c in reference.choices]
    assert prism.usage.completion_tokens == reference.usage.completion_tokens


def test_vllm_s_token_constraints_give_the_same_answers(client, vllm):
    """`allowed_token_ids` and `bad_words` (the SDK's extra_body) hold both servers' sampling alike."""
    plain = both(client, vllm, max_tokens=6, logprobs=True)[0].choices[0]
    first = next(t.token for t in plain.logprobs.content if t.token.strip().isalnum())
    banned = both(client, vllm, max_tokens=6, extra_body={"bad_words": [first.strip()]})
    assert banned[0].choices[0].message.content == banned[1].choices[0].message.content
    assert first.strip() not in banned[0].choices[0].message.content
    allowed = list(range(100, 140))  # some of the byte-level vocabulary's single characters
    kept = both(client, vllm, max_tokens=6, extra_body={"allowed_token_ids": allowed})
    assert kept[0].choices[0].message.content == kept[1].choices[0].message.content != plain.message.content


def test_reasoning_effort_reaches_the_template_alike(client, vllm):
    """The demo template switches thinking off with `enable_thinking`, which vLLM's server sets from the effort."""
    bare = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=4, temperature=0).usage.prompt_tokens
    prism, reference = both(client, vllm, max_tokens=4, reasoning_effort="none")
    assert prism.usage.prompt_tokens == reference.usage.prompt_tokens > bare
    assert prism.choices[0].message.content == reference.choices[0].message.content


def test_continuing_the_client_s_own_start_of_an_answer_is_alike(client, vllm):
    """`continue_final_message` with `add_generation_prompt: false`: the model goes on with the last message."""
    begun = [*QUESTION, {"role": "assistant", "content": "The image shows"}]
    fields = {"continue_final_message": True, "add_generation_prompt": False}
    prism, reference = both(client, vllm, messages=begun, max_tokens=6, extra_body=fields)
    assert prism.usage.prompt_tokens == reference.usage.prompt_tokens
    assert prism.choices[0].message.content == reference.choices[0].message.content
    new_turn = client.chat.completions.create(model=MODEL_NAME, messages=begun, max_tokens=6, temperature=0)
    assert new_turn.usage.prompt_tokens > prism.usage.prompt_tokens  # the closed message and a new turn's header


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_without_a_new_turn_the_answer_s_role_is_the_final_message_s_alike(client, vllm, stream):
    """vLLM's server answers in the final message's role when add_generation_prompt is false."""
    def role(c) -> str:
        fields = dict(model=MODEL_NAME, messages=QUESTION, max_tokens=3, temperature=0, extra_body={"add_generation_prompt": False})
        if not stream:
            return c.chat.completions.create(**fields).choices[0].message.role
        return next(chunk.choices[0].delta.role for chunk in c.chat.completions.create(stream=True, **fields) if chunk.choices)

    assert role(client) == role(vllm) == "user"


def test_token_ids_and_logprob_tokens_named_by_id_are_alike(client, vllm, images):
    """vLLM's `return_token_ids` (the prompt as it ran, each image's rows expanded, and each choice's tokens)
    and `return_tokens_as_token_ids`, answered whole and streamed."""
    messages = [{"role": "user", "content": [image_part(images), {"type": "text", "text": "Describe it."}]}]
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    prism, reference = both(client, vllm, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2, extra_body=extra)
    assert prism.model_extra["prompt_token_ids"] == reference.model_extra["prompt_token_ids"]
    assert len(prism.model_extra["prompt_token_ids"]) == prism.usage.prompt_tokens
    ours, theirs = prism.choices[0], reference.choices[0]
    assert ours.model_extra["token_ids"] == theirs.model_extra["token_ids"] and len(ours.model_extra["token_ids"]) == 5
    assert [(t.token, t.bytes) for t in ours.logprobs.content] == [(t.token, t.bytes) for t in theirs.logprobs.content]
    assert ours.logprobs.content[0].token == f"token_id:{ours.model_extra['token_ids'][0]}"

    def streamed(c) -> tuple[list, list[int]]:
        """The prompts the chunks carry (the first chunk's alone), and the tokens. Not one entry a
        chunk: how many chunks five tokens come in depends on the server's pace (vLLM merges the
        deltas of steps its reader was behind on)."""
        chunks = list(c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True}))
        prompts = [chunk.model_extra.get("prompt_token_ids") for chunk in chunks]
        assert prompts[0] is not None and not any(prompts[1:]), prompts
        return prompts[0], [i for chunk in chunks if chunk.choices for i in chunk.choices[0].model_extra.get("token_ids") or []]

    assert streamed(client) == streamed(vllm)
    assert streamed(client)[1] == ours.model_extra["token_ids"]


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_prompt_logprobs_are_alike(client, vllm, images, with_image):
    """vLLM's `prompt_logprobs`: each prompt position's token and its two likeliest, an image's rows included
    (their logits come from Prism's encoder's tokens on one side, vLLM's own tower on the other)."""
    text = {"type": "text", "text": "Describe the picture in a few words."}
    messages = [{"role": "user", "content": [image_part(images), text] if with_image else [text]}]
    prism, reference = both(client, vllm, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 2})
    ours, theirs = prism.model_extra["prompt_logprobs"], reference.model_extra["prompt_logprobs"]
    assert len(ours) == len(theirs) == prism.usage.prompt_tokens and ours[0] is None is theirs[0]
    for at, (mine, other) in enumerate(zip(ours[1:], theirs[1:]), start=1):
        prompt_token = next(iter(other))  # vLLM's first entry: the prompt's own token
        assert next(iter(mine)) == prompt_token, at
        assert abs(mine[prompt_token]["logprob"] - other[prompt_token]["logprob"]) < 1e-3, at
        assert mine[prompt_token]["decoded_token"] == other[prompt_token]["decoded_token"], at


def test_an_echoed_start_of_an_answer_is_alike(client, vllm):
    """vLLM's `echo` with `continue_final_message`: the client's start of the answer opens it, and with
    `logprobs` the prompt's logprobs come too. Streamed, vLLM's server fails on this model (it puts the
    message's parts, not their text, in the echo's chunk); Prism's stream opens with the echo's chunk."""
    begun = [*QUESTION, {"role": "assistant", "content": "The image shows"}]
    fields = dict(model=MODEL_NAME, messages=begun, max_tokens=4, temperature=0,
                  extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False})
    prism, reference = (c.chat.completions.create(logprobs=True, top_logprobs=1, **fields) for c in (client, vllm))
    assert prism.choices[0].message.content == reference.choices[0].message.content
    assert prism.choices[0].message.content.startswith("The image shows")
    ours, theirs = prism.model_extra["prompt_logprobs"], reference.model_extra["prompt_logprobs"]
    assert len(ours) == len(theirs) == prism.usage.prompt_tokens
    assert [next(iter(at or {None: 0})) for at in ours] == [next(iter(at or {None: 0})) for at in theirs]  # each position's own token
    assert "prompt_logprobs" not in client.chat.completions.create(**fields).model_extra  # vLLM's server computes them anyway
    chunks = [chunk for chunk in client.chat.completions.create(stream=True, **fields) if chunk.choices]
    assert [chunk.choices[0].delta.content for chunk in chunks[:2]] == ["", "The image shows"]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == prism.choices[0].message.content


def described(images) -> list[dict]:
    return [{"role": "user", "content": [image_part(images), {"type": "text", "text": "Describe it."}]}]


def test_logprobs_of_the_client_s_own_token_ids_are_alike(client, vllm, images):
    """vLLM's `logprob_token_ids` (a classifier's labels): each step's logprobs for those ids, in
    place of the likeliest ones, answered whole and streamed."""
    labels = [100, 200, 300]
    extra = {"logprob_token_ids": labels}
    prism, reference = both(client, vllm, messages=described(images), max_tokens=4, logprobs=True, extra_body=extra)
    ours, theirs = prism.choices[0].logprobs.content, reference.choices[0].logprobs.content
    assert [t.token for t in ours] == [t.token for t in theirs] and len(ours) == 4
    for a, b in zip(ours, theirs):
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(a.top_logprobs, b.top_logprobs))
        assert len(a.top_logprobs) >= len(labels)  # each label's, and the sampled token's where it is none of them

    def streamed(c) -> list[list[str]]:
        chunks = c.chat.completions.create(model=MODEL_NAME, messages=described(images), max_tokens=4, temperature=0,
                                           logprobs=True, stream=True, extra_body=extra)
        return [[t.token for t in step.top_logprobs] for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for step in chunk.choices[0].logprobs.content]

    assert streamed(client) == streamed(vllm) == [[t.token for t in step.top_logprobs] for step in ours]


def test_a_repeating_answer_ends_alike_where_repetition_is_detected(client, vllm):
    """vLLM's `repetition_detection`: the choice ends once a pattern of tokens comes round min_count times."""
    extra = {"repetition_detection": {"max_pattern_size": 8, "min_count": 3}}
    prism, reference = both(client, vllm, max_tokens=200, extra_body=extra)
    assert reference.choices[0].finish_reason == "repetition"  # the random-weights model repeats itself within 200 tokens
    assert prism.choices[0].finish_reason == reference.choices[0].finish_reason
    assert prism.choices[0].message.content == reference.choices[0].message.content
    assert prism.choices[0].model_extra["stop_reason"] == reference.choices[0].model_extra["stop_reason"]
    assert prism.usage.completion_tokens == reference.usage.completion_tokens < 200


def test_a_stream_interval_cuts_the_stream_alike(client, vllm):
    """vLLM's `stream_interval`: so many tokens to a chunk (the first alone, as soon as it is made)."""
    def pieces(c) -> list[str]:
        chunks = c.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=10, temperature=0, stream=True,
                                           extra_body={"stream_interval": 4, "return_token_ids": True})
        return [len(chunk.choices[0].model_extra.get("token_ids") or []) for chunk in chunks if chunk.choices]

    assert pieces(client) == pieces(vllm)
    assert max(pieces(client)) == 4


def test_the_prompt_s_text_is_alike(client, vllm, images):
    """vLLM's `return_prompt_text`: the chat template's text, answered whole and in a stream's role chunk."""
    extra = {"return_prompt_text": True}
    prism, reference = both(client, vllm, messages=described(images), max_tokens=2, extra_body=extra)
    assert prism.model_extra["prompt_text"] == reference.model_extra["prompt_text"]
    assert "Describe it." in prism.model_extra["prompt_text"]

    def streamed(c) -> list:
        return [chunk.model_extra.get("prompt_text") for chunk in c.chat.completions.create(
            model=MODEL_NAME, messages=described(images), max_tokens=2, temperature=0, stream=True, extra_body=extra)]

    assert streamed(client) == streamed(vllm)
    assert streamed(client)[0] == prism.model_extra["prompt_text"]


def test_steps_whose_text_is_not_whole_yet_are_streamed_alike(client, vllm):
    """A token that is part of a character makes no text yet: vLLM's server, with a tool parser
    configured (as here), runs it on every request, and it holds such a step back (with no parser it
    streams `content: ""`: tests/unit/test_choice_stream.py)."""
    def contents(c) -> list:
        chunks = c.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=6, temperature=0, stream=True,
                                           extra_body={"allowed_token_ids": [101, 102, 103]})  # bytes that continue a character
        return [(chunk.choices[0].delta.content, chunk.choices[0].finish_reason) for chunk in chunks if chunk.choices]

    ours = contents(client)
    assert ours == contents(vllm)
    assert ours[-1][1] == "length"


LONG_CHAT = [{"role": "system", "content": "You describe pictures."},
             *[{"role": role, "content": f"Turn {i}: {'a longer message ' * 3}"} for i, role in enumerate(["user", "assistant"] * 3)],
             {"role": "user", "content": "And now?"}]


@pytest.mark.parametrize("cut", [{"truncate_prompt_tokens": 30, "truncation_side": "left"}, {"truncate_prompt_tokens": 12},
                                 {"truncate_prompt_tokens": -1}], ids=["last-30", "first-12-by-the-tokenizer-s-side", "context"])
def test_a_prompt_cut_to_so_many_tokens_is_answered_alike(client, vllm, cut):
    """vLLM's `truncate_prompt_tokens` (and `truncation_side`; unset, the tokenizer's, which keeps the first)."""
    prism, reference = both(client, vllm, messages=LONG_CHAT, max_tokens=6, extra_body={**cut, "return_token_ids": True})
    assert prism.model_extra["prompt_token_ids"] == reference.model_extra["prompt_token_ids"]
    assert prism.usage.prompt_tokens == reference.usage.prompt_tokens == (cut["truncate_prompt_tokens"] if cut["truncate_prompt_tokens"] > 0
                                                                         else prism.usage.prompt_tokens)
    assert prism.choices[0].message.content == reference.choices[0].message.content


def test_a_cut_through_an_image_is_refused_and_one_short_of_it_answered_alike(client, vllm, images):
    messages = [{"role": "user", "content": [image_part(images), {"type": "text", "text": "Describe it. " * 10}]}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0).usage.prompt_tokens
    kept = both(client, vllm, messages=messages, max_tokens=4, extra_body={"truncate_prompt_tokens": whole - 2, "truncation_side": "right"})
    assert kept[0].usage.prompt_tokens == kept[1].usage.prompt_tokens == whole - 2
    assert kept[0].choices[0].message.content == kept[1].choices[0].message.content
    for c in (client, vllm):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": whole - 30, "truncation_side": "left"})
