"""Which chat template renders a request, and how it takes a message's content, as vLLM's
server decides (vllm/renderers/hf.py): the processor's template unless the request has tools
(a llava-hf checkpoint's tokenizer may carry its language model's text-only one), and the
content as a list of parts or as one string, whichever the template reads. A text-only
model's template that joins `message['content']` to strings fails on a list of parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class ChatTemplate:
    text: str | None  # the Jinja source; None: the checkpoint has none
    content_format: str = "openai"  # "openai": a message's content is a list of parts; "string": one string
    # "string" only: the model's text for the request's n-th image or video (vLLM's get_placeholder_str)
    placeholder: Callable[[str, int], str | None] | None = None
    # The token vLLM binds each image and video to (the model's image_token_id, video_token_id):
    # a rendered prompt must hold it once per item (llm_engine/prompts.py, check_markers).
    media_tokens: tuple[tuple[str, int], ...] = ()


class ChatTemplates:
    def __init__(self, tokenizer: Any, model_config: Any) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config

    def for_request(self, tools: list[dict] | None) -> ChatTemplate:
        from vllm.renderers.hf import resolve_chat_template, resolve_chat_template_content_format

        text = resolve_chat_template(self.tokenizer, None, tools, model_config=self.model_config)
        content_format = resolve_chat_template_content_format(None, tools, "auto", self.tokenizer, model_config=self.model_config)
        return ChatTemplate(text, content_format, self._placeholder if content_format == "string" else None, self._media_tokens)

    def _placeholder(self, modality: str, count: int) -> str | None:
        return self._model_class.get_placeholder_str(modality, count)

    @cached_property
    def _media_tokens(self) -> tuple[tuple[str, int], ...]:
        found = ((modality, _token_id(self.model_config.hf_config, modality)) for modality in ("image", "video"))
        return tuple((modality, token) for modality, token in found if token is not None)

    @cached_property
    def _model_class(self) -> Any:  # asked only for a request with images: a text-only model's class has no placeholders
        from vllm.model_executor.model_loader import get_model_cls

        return get_model_cls(self.model_config)


def _token_id(hf_config: Any, modality: str) -> int | None:
    """The checkpoint's token for an image or a video: `image_token_id` (Qwen, InternVL) or `image_token_index` (LLaVA)."""
    for suffix in ("id", "index"):
        if isinstance(token := getattr(hf_config, f"{modality}_token_{suffix}", None), int):
            return token
    return None
