"""The engine renders a request with the chat template vLLM's server would pick, and hands it
the content as that template reads it (llm_engine/templates.py): the prompt's token ids are
those vLLM's own renderer makes (vllm/renderers), for a text-only model whose template joins
content to strings, for a checkpoint whose processor and tokenizer carry different templates,
and for a vision model whose template takes one string per message."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import msgspec
import pytest
from PIL import Image

from llm_engine.prompts import render_prompt, request_tools
from llm_engine.requests import read_chat
from llm_engine.templates import ChatTemplates
from prism.tiny_models import ensure_tiny_model
from protocol.to_engine import IMAGE_PLACEHOLDER

# Qwen2.5's text-only template: content joined to strings (vLLM's "string" content format).
STRING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def checkpoint(tmp_path: Path, family: str, tokenizer_template: str | None, processor_template: str | None) -> Path:
    """A copy of the tiny checkpoint with the templates given: the tokenizer's in
    tokenizer_config.json, the processor's in chat_template.json (as llava-hf ships them)."""
    out = tmp_path / family
    shutil.copytree(ensure_tiny_model(family), out)
    (out / "chat_template.jinja").unlink()
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if tokenizer_template is not None:
        config["chat_template"] = tokenizer_template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if processor_template is not None:
        (out / "chat_template.json").write_text(json.dumps({"chat_template": processor_template}))
    return out


def png_url() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def both_renders(path: Path, messages: list[dict]) -> tuple[list[int], list[int], str]:
    """(Prism's token ids, vLLM's, the content format) for `messages`, images as the gateway sends them."""
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import safe_apply_chat_template

    tokenizer = AutoTokenizer.from_pretrained(path)
    model_config = ModelConfig(model=str(path))
    as_sent = json.loads(json.dumps(messages).replace(png_url(), IMAGE_PLACEHOLDER))
    chat = read_chat(msgspec.json.encode({"messages": as_sent, "max_tokens": 4}))
    template = ChatTemplates(tokenizer, model_config).for_request(request_tools(chat))
    ours = render_prompt(chat, tokenizer, {}, template).token_ids
    conversation, _, _ = parse_chat_messages(messages, model_config, content_format=template.content_format)
    text = safe_apply_chat_template(model_config, tokenizer, conversation, tools=None, tokenize=False, add_generation_prompt=True)
    return ours, tokenizer.encode(text, add_special_tokens=False), template.content_format


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": "Another?"},
]


def test_a_text_only_template_that_joins_strings_gets_strings(tmp_path):
    path = checkpoint(tmp_path, "qwen2-text", STRING_TEMPLATE, None)
    ours, theirs, content_format = both_renders(path, CONVERSATION)
    assert content_format == "string" and ours == theirs


@pytest.mark.parametrize("family", ["qwen2.5-vl"])
def test_the_processor_s_template_comes_before_the_tokenizer_s(tmp_path, family):
    """A llava-hf checkpoint carries its language model's text template in the tokenizer and
    the vision one in the processor: vLLM renders with the processor's."""
    from prism.demo_model import CHAT_TEMPLATE

    path = checkpoint(tmp_path, family, STRING_TEMPLATE, CHAT_TEMPLATE)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url()}},
                                             {"type": "text", "text": "What colour?"}]}]
    ours, theirs, content_format = both_renders(path, messages)
    assert content_format == "openai" and ours == theirs


def test_a_vision_template_of_strings_gets_the_model_s_image_placeholders(tmp_path):
    path = checkpoint(tmp_path, "qwen2.5-vl", STRING_TEMPLATE, STRING_TEMPLATE)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                             {"type": "image_url", "image_url": {"url": png_url()}},
                                             {"type": "image_url", "image_url": {"url": png_url()}}]}]
    ours, theirs, content_format = both_renders(path, messages)
    assert content_format == "string" and ours == theirs


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_an_answer_sent_back_with_null_content_is_rendered_empty_as_vllm_renders_it(tmp_path, content_format):
    """An answer cut off inside its reasoning comes with null content (and no reasoning, if hidden)."""
    from prism.demo_model import CHAT_TEMPLATE

    template = STRING_TEMPLATE if content_format == "string" else CHAT_TEMPLATE
    conversation = [*CONVERSATION[:2], {"role": "assistant", "content": None}, CONVERSATION[3]]
    ours, theirs, rendered_as = both_renders(checkpoint(tmp_path, "qwen2-text", template, None), conversation)
    assert rendered_as == content_format and ours == theirs


# A template that knows the `developer` role, and one that refuses a conversation as Qwen3's does.
DEVELOPER_TEMPLATE = STRING_TEMPLATE.replace("message['role']", "('dev' if message['role'] == 'developer' else message['role'])")
REFUSING_TEMPLATE = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('No user query found in messages.') }}{% endif %}" + STRING_TEMPLATE
WITH_DEVELOPER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                  {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "A colour?"}]


@pytest.mark.parametrize("template", [STRING_TEMPLATE, DEVELOPER_TEMPLATE], ids=["becomes-system", "kept"])
def test_developer_messages_are_rendered_as_vllm_renders_them(tmp_path, template):
    """A template that does not name the role gets them as system, merged into the first system message."""
    ours, theirs, _ = both_renders(checkpoint(tmp_path, "qwen2-text", template, None), WITH_DEVELOPER)
    assert ours == theirs


def test_a_template_that_refuses_the_conversation_is_the_request_s_fault(tmp_path):
    from llm_engine.prompts import InvalidPrompt

    with pytest.raises(InvalidPrompt, match="No user query found in messages"):
        both_renders(checkpoint(tmp_path, "qwen2-text", REFUSING_TEMPLATE, None), CONVERSATION)


def _rendered(family: str, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig

    path = ensure_tiny_model(family)
    tokenizer = AutoTokenizer.from_pretrained(path)
    as_sent = json.loads(json.dumps(messages).replace(png_url(), IMAGE_PLACEHOLDER))
    chat = read_chat(msgspec.json.encode({"messages": as_sent, "max_tokens": 4}))
    template = ChatTemplates(tokenizer, ModelConfig(model=str(path))).for_request(request_tools(chat))
    return render_prompt(chat, tokenizer, {}, template).token_ids


# Each family's image token as its tiny checkpoint names it (all as Qwen does; LLaVA's real ones say `<image>`).
IMAGE_TOKEN = "<|image_pad|>"


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "llava-onevision", "llava-next", "internvl3"])
def test_an_image_marker_in_a_request_s_text_is_refused_and_images_alone_are_not(family):
    """vLLM binds the n-th image to the n-th marker in the prompt: one typed into the text would take
    the first image's place, and every image after it would move by one, silently."""
    from llm_engine.prompts import InvalidPrompt

    image = {"type": "image_url", "image_url": {"url": png_url()}}
    assert _rendered(family, [{"role": "user", "content": [image, {"type": "text", "text": "and"}, image]}])
    assert _rendered(family, [{"role": "user", "content": f"what does {IMAGE_TOKEN} mean?"}])  # no image: nothing to move
    with pytest.raises(InvalidPrompt, match="token"):
        _rendered(family, [{"role": "user", "content": [{"type": "text", "text": f"see {IMAGE_TOKEN} here"}, image]}])


def test_a_prompt_longer_than_any_that_fits_the_context_is_refused_before_it_is_tokenized():
    """A token stands for at most as many characters as its vocabulary entry has, so a text longer than the
    context times the longest entry cannot fit; one longer than eight characters a token of context is judged
    by its beginning. Tokenizing it all held the engine's one rendering thread, and every request behind it."""
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig

    from llm_engine.prompts import PREFIX_CHARS_PER_TOKEN, InvalidPrompt, PromptBound

    path = ensure_tiny_model("qwen2.5-vl")
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = ChatTemplates(tokenizer, ModelConfig(model=str(path))).for_request(None)

    def render(text: str, context: int, **cut) -> list[int]:
        chat = read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": text}], "max_tokens": 4, **cut}))
        return render_prompt(chat, tokenizer, {}, template, PromptBound.of(tokenizer, context)).token_ids

    text = "Grüße, 世界! naïve café, ok 🙂 " * 200  # characters of several bytes: more tokens than characters
    bound = PromptBound.of(tokenizer, 64)
    assert len(text) <= len(tokenizer.encode(text)) * bound.longest_token_chars  # the bound holds
    assert len(render(text, 32768)) > 64  # fits a large context, tokenized whole
    with pytest.raises(InvalidPrompt, match="characters; one that fits this model's context has at most"):
        render(text, 64)  # past the context times the longest entry: not tokenized at all
    beginning = text[:64 * bound.longest_token_chars - 300]  # within that (with the template's text), past eight a token
    assert len(beginning) > 64 * PREFIX_CHARS_PER_TOKEN
    with pytest.raises(InvalidPrompt, match="maximum context length is 64 tokens; the prompt's first 512 characters alone"):
        render(beginning, 64)
    # To be truncated (by vLLM's renderer, later), it is cut to what the context's tokens can hold, on the side dropped.
    most = 64 * bound.longest_token_chars
    kept_end = render(text, 64, truncate_prompt_tokens=-1, truncation_side="left")
    assert kept_end == tokenizer.encode(template_text_of(text, tokenizer, template)[-most:])
    kept_start = render(text, 64, truncate_prompt_tokens=20)  # the tokenizer's side: right
    assert kept_start == tokenizer.encode(template_text_of(text, tokenizer, template)[:most])


def template_text_of(text: str, tokenizer, template) -> str:
    chat = read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": text}]}))
    return render_prompt(chat, tokenizer, {}, template).text
