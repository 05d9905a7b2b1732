"""The engine refuses embeddings that would kill vLLM's engine core."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import msgspec

from llm_engine.prompts import InvalidPrompt, ModelShape, check_images, image_data, output_budget, render_prompt, vllm_inputs
from llm_engine.requests import read_chat
from protocol.tensors import to_frame, to_torch
from protocol.to_engine import IMAGE_PLACEHOLDER, GenerateRequest, ImageEmbedding
from protocol.video import VideoEmbedding

SHAPE = ModelShape(embedding_width=128, merge_size=2)
NO_GRID = ModelShape(embedding_width=128, merge_size=None)  # LLaVA-OneVision
QWEN2_VL = ModelShape(embedding_width=128, merge_size=2, family="Qwen2-VL")


class FakeTemplate:
    """Only apply_chat_template is used; the real tokenizer is covered end to end."""

    def apply_chat_template(self, messages, tools, chat_template, tokenize, add_generation_prompt, continue_final_message):
        return "|".join(p.get("text", "<img>") for m in messages for p in m["content"])

    def encode(self, text, add_special_tokens=True):  # transformers' default: a Llama-style tokenizer's BOS
        return (["<s>"] if add_special_tokens else []) + text.split("|")


def chat_bytes(image_parts: int, max_tokens: int | None = 4) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": IMAGE_PLACEHOLDER}}] * image_parts + [{"type": "text", "text": "q"}]
    return msgspec.json.encode({"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens})


def request_with(tensors, grids, image_parts=None, max_tokens: int | None = 4, keys=None):
    images, frames = [], []
    for i, (tensor, grid) in enumerate(zip(tensors, grids)):
        meta, frame = to_frame(tensor)
        key = keys[i] if keys else bytes([i]) * 16
        images.append(ImageEmbedding(meta, grid, key, "ipc:///encoder", b"id-" + key))
        frames.append(frame)
    req = GenerateRequest("r", chat_bytes(len(tensors) if image_parts is None else image_parts, max_tokens), images)
    return req, frames


def tensors_of(req, frames) -> list:
    """The images' tensors as the engine has them once checked and fetched (here: made from the frames)."""
    return [to_torch(image.embeddings, frame) for image, frame in zip(req.images, frames)]


def inputs_of(req, frames, shape) -> dict:
    """As the engine does: every image checked, then its tensor had, then vLLM's inputs (which
    vLLM's renderer then expands; tests/integration/test_families.py checks the count)."""
    chat = read_chat(req.chat)
    check_images(chat, req, shape)
    return vllm_inputs(render_prompt(chat, FakeTemplate(), {}).token_ids, req, tensors_of(req, frames), shape)


def test_valid_images_are_concatenated_flat_with_their_grids():
    req, frames = request_with([torch.randn(4, 128), torch.randn(6, 128)], [(1, 4, 4), (1, 4, 6)])
    data = image_data(req, tensors_of(req, frames), SHAPE)["image"]
    assert data["image_embeds"].shape == (10, 128) and data["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    inputs = inputs_of(req, frames, SHAPE)
    assert inputs["multi_modal_data"]["image"]["image_embeds"].shape == (10, 128)
    assert inputs["prompt_token_ids"] == ["<img>", "<img>", "q"]  # one placeholder per image


def test_vllm_is_given_the_token_ids_it_would_have_made_not_the_text():
    req, frames = request_with([torch.randn(4, 128)], [(1, 4, 4)])
    inputs = inputs_of(req, frames, SHAPE)
    assert inputs["prompt_token_ids"] == ["<img>", "q"]
    assert "prompt" not in inputs  # vLLM would tokenize the text a second time


def test_the_tokenizer_s_special_tokens_join_the_template_s_only_where_asked_as_on_vllm_s_server():
    """vLLM's `add_special_tokens` (off: the chat template writes its own BOS)."""
    asked = msgspec.json.encode({"messages": [{"role": "user", "content": "q"}], "add_special_tokens": True})
    rendered = render_prompt(read_chat(asked), FakeTemplate(), {})
    assert rendered == ("q", ["<s>", "q"])
    assert render_prompt(read_chat(chat_bytes(0)), FakeTemplate(), {}).token_ids == ["q"]


def test_content_keys_reach_vllm_as_its_multimodal_uuids():
    keys = [b"\x01" * 16, b"\xab" * 16]
    req, frames = request_with([torch.randn(4, 128), torch.randn(6, 128)], [(1, 4, 4), (1, 4, 6)], keys=keys)
    assert inputs_of(req, frames, SHAPE)["multi_modal_uuids"] == {"image": ["01" * 16, "ab" * 16]}


@pytest.mark.parametrize(
    "tensor,grid,message",
    [
        (torch.randn(1, 4, 128), (1, 4, 4), "must be 2-D"),
        (torch.randn(5, 128), (1, 4, 4), "does not match grid"),
        (torch.randn(4, 64), (1, 4, 4), "does not match grid"),
        (torch.randn(4, 128), (1, 3, 4), "multiple of merge size"),
        (torch.randn(4, 128), (0, 4, 4), "multiple of merge size"),
        (torch.zeros(4, 128, dtype=torch.int32), (1, 4, 4), "not a float type"),
    ],
    ids=["3-D", "rows", "hidden", "odd-grid", "zero-grid", "int"],
)
def test_bad_shapes_are_refused_before_vllm(tensor, grid, message):
    req, frames = request_with([tensor], [grid])
    with pytest.raises(InvalidPrompt, match=message):
        inputs_of(req, frames, SHAPE)


def test_images_without_a_grid_go_to_vllm_as_a_list_of_their_own_lengths():
    req, frames = request_with([torch.randn(7, 128), torch.randn(3, 128)], [None, None])
    images = image_data(req, tensors_of(req, frames), NO_GRID)["image"]
    assert [tuple(x.shape) for x in images] == [(7, 128), (3, 128)]
    assert [tuple(x.shape) for x in inputs_of(req, frames, NO_GRID)["multi_modal_data"]["image"]] == [(7, 128), (3, 128)]


@pytest.mark.parametrize(
    "tensor,grid,shape,message",
    [
        (torch.randn(4, 64), None, NO_GRID, "does not match the model"),
        (torch.randn(0, 128), None, NO_GRID, "must be 2-D"),
        (torch.randn(4, 128), (1, 4, 4), NO_GRID, "have no grid"),
        (torch.randn(4, 128), None, SHAPE, "needs each image's"),
    ],
    ids=["width", "empty", "grid-for-none", "no-grid-for-qwen"],
)
def test_a_grid_is_given_exactly_where_the_family_has_one(tensor, grid, shape, message):
    req, frames = request_with([tensor], [grid])
    with pytest.raises(InvalidPrompt, match=message):
        inputs_of(req, frames, shape)


def test_more_images_than_vllm_takes_in_one_prompt_are_refused_naming_the_key():
    """Qwen3-VL runs with vLLM's tower loaded, under limit_mm_per_prompt: past it vLLM's own
    error would name its flag, not the engine's key."""
    req, frames = request_with([torch.randn(4, 128)] * 3, [(1, 4, 4)] * 3)
    with pytest.raises(InvalidPrompt, match=r"3 images in one prompt; this engine takes at most 2 \(engine.max_images_per_prompt\)"):
        inputs_of(req, frames, dataclasses.replace(SHAPE, max_images=2))
    assert inputs_of(req, frames, dataclasses.replace(SHAPE, max_images=3))["multi_modal_data"]


def test_placeholder_count_must_match_images():
    req, frames = request_with([torch.randn(4, 128)], [(1, 4, 4)], image_parts=2)
    with pytest.raises(InvalidPrompt, match="2 image parts"):
        inputs_of(req, frames, SHAPE)



def test_text_only_request_has_no_multimodal_data():
    req, frames = request_with([], [])
    assert "multi_modal_data" not in inputs_of(req, frames, SHAPE)


@pytest.mark.parametrize("max_tokens,budget", [(None, 4096 - 1), (100, 100)])
def test_output_budget_defaults_to_the_rest_of_the_context(max_tokens, budget):
    req, _ = request_with([], [], max_tokens=max_tokens)
    assert output_budget(read_chat(req.chat), 1, 4096) == budget


def test_an_output_limit_past_the_context_left_is_cut_to_it_as_vllm_s_server_does():
    """vLLM's server gives a completion what the context has left, refusing only a limit over the
    whole context or a prompt that fills it (vllm/entrypoints/serve/utils/api_utils.py)."""
    def budget(max_tokens: int, prompt_tokens: int) -> int:
        return output_budget(read_chat(request_with([], [], max_tokens=max_tokens)[0].chat), prompt_tokens, 32)

    assert budget(30, 5) == 27
    with pytest.raises(InvalidPrompt, match="max_tokens=33 cannot be greater than this model's context length, 32"):
        budget(33, 5)
    with pytest.raises(InvalidPrompt, match="maximum context length is 32 tokens; the prompt has 32"):
        budget(3, 32)


def test_a_limit_past_the_context_is_refused_naming_the_field_it_came_in():
    chat = read_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 33}))
    with pytest.raises(InvalidPrompt, match="max_completion_tokens=33 cannot be greater") as refused:
        output_budget(chat, 5, 32)
    assert refused.value.param == "max_completion_tokens"


def test_the_checkpoint_s_max_new_tokens_is_the_default_limit():
    req, _ = request_with([], [], max_tokens=None)
    assert output_budget(read_chat(req.chat), 1, 4096, {"max_tokens": 512}) == 512


def test_a_message_of_images_alone_counts_every_image():
    # OpenAI's user-message type validates an all-image content lazily: read once, it is gone.
    req, frames = request_with([torch.randn(4, 128), torch.randn(4, 128)], [(1, 4, 4), (1, 4, 4)])
    chat = msgspec.json.decode(req.chat)
    chat["messages"][0]["content"] = chat["messages"][0]["content"][:2]
    req = GenerateRequest(req.request_id, msgspec.json.encode(chat), req.images)
    assert inputs_of(req, frames, SHAPE)["prompt_token_ids"] == ["<img>", "<img>"]


def video_request(video_rows: int, video_parts: int = 1, dtype=torch.float32, grid=(2, 4, 4)):
    """An image then a video in one message (the engine finds each tensor as an image's)."""
    image, image_frame = to_frame(torch.randn(4, 128))
    video, video_frame = to_frame(torch.randn(video_rows, 128).to(dtype))
    parts = ([{"type": "image_url", "image_url": {"url": IMAGE_PLACEHOLDER}}]
             + [{"type": "video_url", "video_url": {"url": IMAGE_PLACEHOLDER}}] * video_parts + [{"type": "text", "text": "q"}])
    chat = msgspec.json.encode({"messages": [{"role": "user", "content": parts}], "max_tokens": 4})
    req = GenerateRequest("r", chat, [ImageEmbedding(image, (1, 4, 4), b"i" * 16, "ipc:///encoder", b"id")],
                          [VideoEmbedding(video, grid, key=b"v" * 16, source="ipc:///encoder", identity=b"vid")])
    return req, [to_torch(image, image_frame), to_torch(video, video_frame)]


def test_a_video_goes_to_vllm_beside_the_images_keyed_by_its_content_key():
    req, tensors = video_request(8)
    chat = read_chat(req.chat)
    check_images(chat, req, QWEN2_VL)
    inputs = vllm_inputs(render_prompt(chat, FakeTemplate(), {}).token_ids, req, tensors, QWEN2_VL)
    video = inputs["multi_modal_data"]["video"]
    assert torch.equal(video["video_embeds"], tensors[1]) and video["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert inputs["multi_modal_data"]["image"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert inputs["multi_modal_uuids"] == {"image": [(b"i" * 16).hex()], "video": [(b"v" * 16).hex()]}
    assert len(inputs["prompt_token_ids"]) == 3  # image, video, text: one placeholder each


def test_a_video_part_without_its_tokens_or_tokens_of_another_grid_are_refused():
    req, tensors = video_request(8, video_parts=2)
    with pytest.raises(InvalidPrompt, match="2 video parts in the messages but 1 videos sent"):
        check_images(read_chat(req.chat), req, QWEN2_VL)
    req, tensors = video_request(6)
    chat = read_chat(req.chat)
    with pytest.raises(ValueError, match=r"videos\[0\]: embeddings of shape \(6, 128\), expected \(8, 128\)"):
        vllm_inputs(render_prompt(chat, FakeTemplate(), {}).token_ids, req, tensors, QWEN2_VL)


@pytest.mark.parametrize("rows,dtype,grid,needle", [
    (8, torch.int64, (2, 4, 4), "video 0: embeddings dtype int64 is not a float type"),
    (4, torch.float32, (1, 3, 3), r"video 0: grid \(1, 3, 3\) is not a positive multiple of merge size 2"),
    (6, torch.float32, (2, 4, 4), r"video 0: embeddings shape \(6, 128\) does not match grid \(2, 4, 4\)"),
])
def test_a_video_s_embeddings_are_checked_before_they_are_fetched_as_an_image_s_are(rows, dtype, grid, needle):
    """A tensor of no token dtype, or a grid vLLM's positions cannot match, would reach vLLM's engine core."""
    req, _ = video_request(rows, dtype=dtype, grid=grid)
    with pytest.raises(InvalidPrompt, match=needle):
        check_images(read_chat(req.chat), req, QWEN2_VL)
