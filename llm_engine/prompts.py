"""Turn a GenerateRequest into a vLLM prompt, refusing anything that would
reach the engine core in a shape it cannot take.

vLLM accepts some malformed embeddings at its front end and then dies in the
engine core (a 3-D tensor does that), so every shape is checked here: one
placeholder per image, 2-D embeddings, the family's width, and for families
with a grid, rows = t·h·w / merge². vLLM takes Qwen's families' images as one
flat tensor plus their grids, and LLaVA's and InternVL's as a list of tensors
(each image's length is its own; vLLM counts its placeholders from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from llm_engine.templates import ChatTemplate
from llm_engine.videos import check_video, embeds_of, video_data
from protocol.tensors import TOKEN_DTYPES
from protocol.to_engine import GenerateRequest

OPENAI_CONTENT = ChatTemplate(None)  # content as a list of parts, with the tokenizer's own template


class InvalidPrompt(ValueError):
    """The request cannot be served as sent (answered with HTTP 400); `param`: the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ModelShape:
    """What every image's embeddings must look like (None where a model takes no images)."""

    embedding_width: int  # columns vLLM takes per visual token (the family says: hidden, or more)
    merge_size: int | None  # None: the family's images have no grid (LLaVA, InternVL)
    family: str = ""  # common/families.py's name: which time axis its videos need (llm_engine/videos.py)
    # vLLM's limit_mm_per_prompt for images, for a family it runs with its tower (engine.max_images_per_prompt)
    max_images: int | None = None


def template_messages(messages: list[dict], template: ChatTemplate = OPENAI_CONTENT) -> list[dict]:
    """The conversation as vLLM's renderer hands it to an HF chat template: content as a
    list of parts (`content_format` "openai") or as one string (a template that reads it so),
    tool results as one string, tool-call arguments as objects."""
    from vllm.renderers.chat_utils import _postprocess_messages

    out = []
    counts = {"image": 0, "video": 0}  # vLLM numbers a request's images and videos across its messages
    for message in messages:
        content = message.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        rendered = {"role": message["role"], "content": [_template_part(p) for p in parts]}
        if template.content_format == "string":
            rendered["content"] = _as_string(rendered["content"], counts, template.placeholder)
        if message["role"] == "tool":
            rendered["content"] = "\n".join(p["text"] for p in parts if p.get("type") == "text")
            if "tool_call_id" in message:
                rendered["tool_call_id"] = message["tool_call_id"]
        if message.get("tool_calls") is not None:
            rendered["tool_calls"] = [dict(call, function=dict(call["function"])) for call in message["tool_calls"]]
        if isinstance(message.get("name"), str):
            rendered["name"] = message["name"]
        if message["role"] == "assistant" and isinstance(message.get("reasoning"), str):
            rendered["reasoning"] = rendered["reasoning_content"] = message["reasoning"]  # both names, as vLLM's renderer
        out.append(rendered)
    _postprocess_messages(out)  # vLLM's: arguments JSON text -> object, as templates expect
    return out


def _as_string(parts: list[dict], counts: dict[str, int], placeholder) -> str:
    """One message's parts as vLLM's "string" content format joins them: its texts on lines,
    after the model's placeholder for each image and video (vllm/renderers/chat_utils.py)."""
    from vllm.renderers.chat_utils import _get_full_multimodal_text_prompt

    texts = [part["text"] for part in parts if part["type"] == "text"]
    storage: dict[str, list[str]] = {}
    for part in parts:
        if part["type"] in counts:
            counts[part["type"]] += 1
            if (text := placeholder(part["type"], counts[part["type"]])) is not None:
                storage.setdefault(part["type"], []).append(text)
    return _get_full_multimodal_text_prompt(storage, texts, interleave_strings=False) if storage else "\n".join(texts)


def _template_part(part: dict) -> dict:
    if _is_image(part):
        return {"type": "image"}
    if _is_video(part):
        return {"type": "video"}
    if part.get("type") == "refusal":  # an earlier answer's refusal: text, as vLLM's renderer reads it
        return {"type": "text", "text": part.get("refusal", "")}
    return {"type": "text", "text": part.get("text", "")}


def _is_video(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "video_url"


def video_parts(messages: list[dict]) -> int:
    return sum(_is_video(part) for m in messages if isinstance(m.get("content"), list) for part in m["content"])


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def image_parts(messages: list[dict]) -> int:
    return sum(_is_image(part) for m in messages if isinstance(m.get("content"), list) for part in m["content"])


def check_images(chat, request: GenerateRequest, shape: ModelShape | None) -> None:
    """One image part per image sent, one video part per video, and every image's and video's
    embeddings, as described, fit the model: checked before any tensor is fetched."""
    sent = len(request.images)
    if (parts := image_parts(chat.messages)) != sent:
        raise InvalidPrompt(f"{parts} image parts in the messages but {sent} images sent")
    if sent and shape is None:
        raise InvalidPrompt("this model is text-only: it takes no images")
    if shape is not None and shape.max_images is not None and sent > shape.max_images:
        raise InvalidPrompt(f"{sent} images in one prompt; this engine takes at most {shape.max_images} "
                            "(engine.max_images_per_prompt)")
    for index, image in enumerate(request.images):
        _check(f"image {index}", image, shape)
    if (parts := video_parts(chat.messages)) != len(request.videos):
        raise InvalidPrompt(f"{parts} video parts in the messages but {len(request.videos)} videos sent")
    if request.videos and (shape is None or shape.merge_size is None):
        raise InvalidPrompt("this model takes no videos")
    for index, video in enumerate(request.videos):
        _check(f"video {index}", video, shape)


def image_data(request: GenerateRequest, tensors: list, shape: ModelShape | None) -> dict | None:
    """vLLM's `multi_modal_data["image"]` for the request's checked embeddings, or None without images."""
    if not request.images:
        return None
    dtype = tensors[0].dtype
    if shape.merge_size is None:
        return {"image": [x.to(dtype) for x in tensors]}
    grids = torch.tensor([image.grid_thw for image in request.images], dtype=torch.int64)
    # One image (the common case) is passed as it is: a cat would copy its megabytes of tokens per request.
    embeds = tensors[0] if len(tensors) == 1 else torch.cat([x.to(dtype) for x in tensors])
    return {"image": {"image_embeds": embeds, "image_grid_thw": grids}}


def _check(what: str, item, shape: ModelShape) -> None:
    """An image's or a video's embeddings, as described, against the model (vLLM's engine core dies of some
    shapes its front end lets through); nothing is fetched yet."""
    meta = item.embeddings
    if meta.dtype not in TOKEN_DTYPES:
        raise InvalidPrompt(f"{what}: embeddings dtype {meta.dtype} is not a float type")
    if len(meta.shape) != 2 or meta.shape[0] < 1:
        raise InvalidPrompt(f"{what}: embeddings must be 2-D (tokens, hidden), got shape {meta.shape}")
    rows = meta.shape[0]
    if shape.merge_size is None:
        if item.grid_thw is not None:
            raise InvalidPrompt(f"{what}: this model's images have no grid, got grid {item.grid_thw}")
    else:
        if item.grid_thw is None:
            raise InvalidPrompt(f"{what}: this model needs each image's (t, h, w) grid")
        t, h, w = item.grid_thw
        if min(t, h, w) < 1 or h % shape.merge_size or w % shape.merge_size:
            raise InvalidPrompt(f"{what}: grid {item.grid_thw} is not a positive multiple of merge size {shape.merge_size}")
        rows = t * h * w // shape.merge_size**2
    if meta.shape != (rows, shape.embedding_width):
        given = f"grid {item.grid_thw}" if item.grid_thw else "the model"
        raise InvalidPrompt(f"{what}: embeddings shape {meta.shape} does not match {given} (expected ({rows}, {shape.embedding_width}))")


@dataclass(frozen=True)
class Prompt:
    inputs: dict  # vLLM's rendered EngineInput: what generate() takes, every placeholder expanded
    num_tokens: int  # its length, as vLLM's server counts a prompt
    max_tokens: int  # output budget, checked against the context length
    text: str | None  # the chat template's, where the request asked (vLLM's return_prompt_text)


class RenderedPrompt(NamedTuple):
    text: str  # the chat template's
    token_ids: list[int]  # its tokens, one placeholder per image and video


def render_prompt(chat, tokenizer, template_kwargs: dict, template: ChatTemplate | None = None,
                  bound: PromptBound | None = None) -> RenderedPrompt:
    """The chat template's text and token ids, one placeholder token per image (vLLM
    expands each to the image's rows). `chat`: vLLM's ChatCompletionRequest;
    `template`: the one vLLM's server would use (llm_engine/templates.py; None: the tokenizer's);
    `bound`: the context's, checked before the whole text is tokenized."""
    from vllm.renderers.hf import _template_error_reason

    template = template or OPENAI_CONTENT
    messages = _developer_messages(template_messages(chat.messages, template), template.text or getattr(tokenizer, "chat_template", None))
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=request_tools(chat), chat_template=template.text, tokenize=False,
            add_generation_prompt=chat.add_generation_prompt, continue_final_message=chat.continue_final_message, **template_kwargs,
        )
    except Exception as exc:  # a template refusing the conversation (roles out of order, no user turn): the request's fault
        raise InvalidPrompt(f"the chat template refused this conversation: {_template_error_reason(exc)}") from None
    tokenized = text
    if bound is not None and chat.truncate_prompt_tokens is not None:  # vLLM's renderer cuts the tokens (render_for_vllm)
        tokenized = bound.trimmed(text, chat.truncation_side or tokenizer.truncation_side)
    elif bound is not None:
        bound.check(text, tokenizer)
    # Token ids, not text: the ids are needed for the length check anyway, and
    # vLLM then skips tokenizing again (part of its input processing).
    token_ids = tokenizer.encode(tokenized, add_special_tokens=chat.add_special_tokens)  # vLLM's: off unless asked
    check_markers(token_ids, chat.messages, template.media_tokens)
    return RenderedPrompt(text, token_ids)


# Of a text longer than this many characters a token of context, only the first so many are
# tokenized to judge it: prose is some four characters a token, so they hold twice the context.
PREFIX_CHARS_PER_TOKEN = 8


@dataclass(frozen=True)
class PromptBound:
    """A prompt too long for the context, refused before the whole of it is tokenized: tokenizing
    takes the engine's one rendering thread, and every request queued behind it, seconds for each
    few megabytes. A token stands for at most as many
    characters as its vocabulary entry has (byte-level BPE writes each byte as one, SentencePiece
    each character as itself): a text longer than the context times the longest entry cannot fit.
    Past PREFIX_CHARS_PER_TOKEN characters a token, its beginning is tokenized first."""

    max_model_len: int
    longest_token_chars: int

    @classmethod
    def of(cls, tokenizer, max_model_len: int) -> "PromptBound":
        return cls(max_model_len, max(map(len, tokenizer.get_vocab())))

    def trimmed(self, text: str, side: str) -> str:
        """A text to be truncated to at most the context's tokens, cut first to as many characters as
        those can hold, from the side truncation drops (as vLLM's renderer cuts it before tokenizing)."""
        most = self.max_model_len * self.longest_token_chars
        if len(text) <= most:
            return text
        return text[-most:] if side == "left" else text[:most]

    def check(self, text: str, tokenizer) -> None:
        most = self.max_model_len * self.longest_token_chars
        if len(text) > most:
            raise InvalidPrompt(f"the prompt is {len(text)} characters; one that fits this model's context has at most "
                                f"{most} (the context's tokens times its longest token's characters)", "messages")
        prefix = self.max_model_len * PREFIX_CHARS_PER_TOKEN
        if len(text) <= prefix:
            return
        # A cut can split what the whole text makes one token into as many as it has characters.
        tokens = len(tokenizer.encode(text[:prefix], add_special_tokens=False)) - self.longest_token_chars
        if tokens >= self.max_model_len:
            raise InvalidPrompt(f"this model's maximum context length is {self.max_model_len} tokens; the prompt's "
                                f"first {prefix} characters alone are more than {tokens}", "messages")


def check_markers(token_ids: list[int], messages: list[dict], media_tokens: tuple[tuple[str, int], ...]) -> None:
    """The prompt holds the model's image token (Qwen's `<|image_pad|>`, LLaVA's `<image>`) once per
    image, and its video token once per video. vLLM binds the n-th image to the n-th such token, so
    one in a request's text (a pasted model card, a tool's output) would move every image after it
    to the wrong place, silently: such a request is refused instead. With no image, nothing moves."""
    for modality, token in media_tokens:
        count = image_parts(messages) if modality == "image" else video_parts(messages)
        if count and (found := token_ids.count(token)) != count:
            raise InvalidPrompt(f"the request's text holds the model's {modality} token ({found} in the prompt for {count} "
                                f"{modality}s), which would move its {modality}s to the wrong places: remove it from the text",
                                "messages")


def _developer_messages(messages: list[dict], template_text: str | None) -> list[dict]:
    """vLLM's server's: `developer` messages stay so for a template that names the role;
    otherwise they become `system`, and every system message is merged into the first."""
    from vllm.renderers.hf import _consolidate_system_messages, _convert_developer_to_system, _detect_developer_role_support

    if not any(m["role"] == "developer" for m in messages) or (template_text and _detect_developer_role_support(template_text)):
        return messages
    return _consolidate_system_messages(_convert_developer_to_system(messages))


def request_tools(chat) -> list[dict] | None:
    """The request's tools as a chat template takes them."""
    return [tool.model_dump() for tool in chat.tools] if chat.tools else None


def vllm_inputs(token_ids: list[int], request: GenerateRequest, tensors: list, shape: ModelShape | None,
                cache_salt: str | None = None) -> dict:
    """The prompt as vLLM's renderer takes it: the chat template's token ids with one
    placeholder per image and video, and their embeddings. `token_ids`: render_prompt's;
    `tensors`: each image's embeddings, then each video's, checked (check_images) and
    fetched (llm_engine/images.py); `cache_salt`: the request's (vLLM's prefix cache is kept apart by it)."""
    inputs: dict = {"prompt_token_ids": token_ids} | ({"cache_salt": cache_salt} if cache_salt is not None else {})
    image_tensors, video_tensors = tensors[:len(request.images)], tensors[len(request.images):]
    if (images := image_data(request, image_tensors, shape)) is not None:
        inputs["multi_modal_data"] = images
        inputs["multi_modal_uuids"] = {"image": [image.key.hex() for image in request.images]}  # Prism's content keys: vLLM hashes nothing
    if request.videos:
        videos = [embeds_of(video, tensor) for video, tensor in zip(request.videos, video_tensors)]
        for index, video in enumerate(videos):
            check_video(video, shape.family, shape.embedding_width, shape.merge_size, index)
        inputs.setdefault("multi_modal_data", {})["video"] = video_data(videos, shape.family)
        inputs.setdefault("multi_modal_uuids", {})["video"] = [video.key.hex() for video in request.videos]
    return inputs


async def render_for_vllm(renderer, model_config, inputs: dict, chat) -> tuple[dict, int]:
    """vLLM's EngineInput for `inputs` and its length, rendered as vLLM's server renders a
    chat before it sets the output budget: each placeholder expanded to the model's own
    tokens (an image's rows, InternVL's `<img>` `</img>` around them, Qwen3-VL's timestamp
    text between a video's frames), so the count is the one vLLM's server checks. The chat's
    `truncate_prompt_tokens` cuts the prompt there, as vLLM's server cuts it: before and after
    the placeholders are expanded, refusing a cut through an image or video."""
    from vllm.renderers.inputs.preprocess import extract_prompt_len, parse_model_prompt

    tok_params = chat.build_tok_params(model_config) if chat.truncate_prompt_tokens is not None else None  # None: the renderer's
    (engine_input,) = await renderer.render_cmpl_async([parse_model_prompt(model_config, inputs)], tok_params)
    return engine_input, extract_prompt_len(model_config, engine_input)


def output_budget(chat, prompt_tokens: int, max_model_len: int, generation_defaults: dict | None = None) -> int:
    """The completion's max_tokens for a prompt of `prompt_tokens` (vLLM's count), as vLLM's server
    sets it: a limit over the context length, or a prompt that leaves no room, is refused; otherwise
    the completion gets what was asked (else the checkpoint's max_new_tokens), at most what the
    context has left (vllm/entrypoints/serve/utils/api_utils.py, get_max_tokens)."""
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    field = "max_completion_tokens" if chat.max_completion_tokens is not None else "max_tokens"
    requested = getattr(chat, field)
    if requested is not None and requested > max_model_len:
        raise InvalidPrompt(f"{field}={requested} cannot be greater than this model's context length, {max_model_len} tokens: "
                            "request fewer output tokens", field)
    if prompt_tokens >= max_model_len:
        raise InvalidPrompt(f"this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_tokens}", "messages")
    return get_max_tokens(max_model_len, requested, prompt_tokens, generation_defaults or {})
