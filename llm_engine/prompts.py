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
from protocol.to_engine import ChatMessage, GenerateRequest

_FLOAT_DTYPES = {"float32", "bfloat16", "float16"}


class InvalidPrompt(ValueError):
    """The request cannot be served as sent (answered with HTTP 400)."""


@dataclass(frozen=True)
class ModelShape:
    embedding_width: int  # columns vLLM takes per visual token (the family says: hidden, or more)
    merge_size: int


def chat_dicts(messages: list[ChatMessage]) -> list[dict]:
    return [
        {"role": m.role, "content": [{"type": p.type, "text": p.text} if p.type == "text" else {"type": "image"} for p in m.content]}
        for m in messages
    ]


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


def build_prompt(request: GenerateRequest, frames: list, tokenizer, shape: ModelShape, max_model_len: int) -> Prompt:
    image_parts = sum(p.type == "image" for m in request.messages for p in m.content)
    if image_parts != len(request.images):
        raise InvalidPrompt(f"{image_parts} image parts in the messages but {len(request.images)} images sent")
    text = tokenizer.apply_chat_template(chat_dicts(request.messages), tokenize=False, add_generation_prompt=True)
    inputs: dict = {"prompt": text}
    images = image_tensors(request, frames, shape)
    visual_tokens = 0
    if images is not None:
        embeds, grid = images
        inputs["multi_modal_data"] = {"image": {"image_embeds": embeds, "image_grid_thw": grid}}
        visual_tokens = embeds.shape[0] - len(request.images)  # each placeholder becomes `rows` tokens
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False)) + visual_tokens
    return Prompt(inputs, num_tokens, _output_budget(request.sampling.max_tokens, num_tokens, max_model_len))


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
