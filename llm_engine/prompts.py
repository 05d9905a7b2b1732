"""Turn a GenerateRequest into a vLLM prompt, refusing anything that would
reach the engine core in a shape it cannot take.

vLLM accepts some malformed embeddings at its front end and then dies in the
engine core (a 3-D tensor does that), so every shape is checked here: one
placeholder per image, 2-D embeddings, the family's width, rows = t·h·w / merge².
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.tensors import to_torch
from protocol.to_engine import GenerateRequest

_FLOAT_DTYPES = {"float32", "bfloat16", "float16"}


class InvalidPrompt(ValueError):
    """The request cannot be served as sent (answered with HTTP 400)."""


@dataclass(frozen=True)
class ModelShape:
    embedding_width: int  # columns vLLM takes per visual token (the family says: hidden, or more)
    merge_size: int


def template_messages(messages: list[dict]) -> list[dict]:
    """The conversation as vLLM's renderer hands it to an HF chat template
    (`content_format` "openai"): content as a list of parts, tool results as
    one string, tool-call arguments as objects."""
    from vllm.renderers.chat_utils import _postprocess_messages

    out = []
    for message in messages:
        content = message.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        rendered = {"role": message["role"], "content": [_template_part(p) for p in parts]}
        if message["role"] == "tool":
            rendered["content"] = "\n".join(p["text"] for p in parts if p.get("type") == "text")
            if "tool_call_id" in message:
                rendered["tool_call_id"] = message["tool_call_id"]
        if message.get("tool_calls") is not None:
            rendered["tool_calls"] = [dict(call, function=dict(call["function"])) for call in message["tool_calls"]]
        if isinstance(message.get("name"), str):
            rendered["name"] = message["name"]
        out.append(rendered)
    _postprocess_messages(out)  # vLLM's: arguments JSON text -> object, as templates expect
    return out


def _template_part(part: dict) -> dict:
    return {"type": "image"} if _is_image(part) else {"type": "text", "text": part.get("text", "")}


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def image_parts(messages: list[dict]) -> int:
    return sum(_is_image(part) for m in messages if isinstance(m.get("content"), list) for part in m["content"])


def image_tensors(request: GenerateRequest, frames: list, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validated (flat embeddings, grid_thw) for all images, or None without images."""
    if len(frames) != len(request.images):
        raise InvalidPrompt(f"{len(frames)} embedding frames for {len(request.images)} images")
    if not request.images:
        return None
    tensors, grids = [], []
    for index, (image, frame) in enumerate(zip(request.images, frames)):
        meta = image.embeddings
        t, h, w = image.grid_thw
        if meta.dtype not in _FLOAT_DTYPES:
            raise InvalidPrompt(f"image {index}: embeddings dtype {meta.dtype} is not a float type")
        if len(meta.shape) != 2:
            raise InvalidPrompt(f"image {index}: embeddings must be 2-D (tokens, hidden), got shape {meta.shape}")
        if min(t, h, w) < 1 or h % shape.merge_size or w % shape.merge_size:
            raise InvalidPrompt(f"image {index}: grid {image.grid_thw} is not a positive multiple of merge size {shape.merge_size}")
        rows = t * h * w // shape.merge_size**2
        if meta.shape != (rows, shape.embedding_width):
            raise InvalidPrompt(f"image {index}: embeddings shape {meta.shape} does not match grid {image.grid_thw} (expected ({rows}, {shape.embedding_width}))")
        tensors.append(to_torch(meta, frame))
        grids.append(image.grid_thw)
    dtype = tensors[0].dtype
    flat = torch.cat([x.to(dtype) for x in tensors])
    return flat, torch.tensor(grids, dtype=torch.int64)


@dataclass(frozen=True)
class Prompt:
    inputs: dict  # what vLLM's generate() takes
    num_tokens: int  # after each image placeholder is expanded to its visual tokens
    max_tokens: int  # output budget, checked against the context length


def build_prompt(chat, request: GenerateRequest, frames: list, tokenizer, shape: ModelShape, max_model_len: int,
                 template_kwargs: dict) -> Prompt:
    """`chat`: vLLM's ChatCompletionRequest read from `request.chat`."""
    if (parts := image_parts(chat.messages)) != len(request.images):
        raise InvalidPrompt(f"{parts} image parts in the messages but {len(request.images)} images sent")
    tools = [tool.model_dump() for tool in chat.tools] if chat.tools else None
    text = tokenizer.apply_chat_template(
        template_messages(chat.messages), tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs,
    )
    inputs: dict = {"prompt": text}
    images = image_tensors(request, frames, shape)
    visual_tokens = 0
    if images is not None:
        embeds, grid = images
        inputs["multi_modal_data"] = {"image": {"image_embeds": embeds, "image_grid_thw": grid}}
        visual_tokens = embeds.shape[0] - len(request.images)  # each placeholder becomes `rows` tokens
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False)) + visual_tokens
    requested = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
    return Prompt(inputs, num_tokens, _output_budget(requested, num_tokens, max_model_len))


def _output_budget(requested: int | None, prompt_tokens: int, max_model_len: int) -> int:
    if prompt_tokens >= max_model_len:
        raise InvalidPrompt(f"this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_tokens}")
    if requested is None:
        return max_model_len - prompt_tokens
    if prompt_tokens + requested > max_model_len:
        raise InvalidPrompt(
            f"this model's maximum context length is {max_model_len} tokens; you requested {prompt_tokens + requested} "
            f"({prompt_tokens} in the prompt, {requested} for the completion): reduce max_tokens or the input"
        )
    return requested
