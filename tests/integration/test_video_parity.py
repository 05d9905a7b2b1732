"""Videos: Prism's encoder tokens, given to vLLM as video embeddings, against
vLLM's own raw-video path, on tiny checkpoints of Qwen2-VL (the demo
family), Qwen2.5-VL and Qwen3-VL, float32, in one vLLM engine per family.

Both paths start from the frames and metadata vLLM's own video loader
yields for each clip (its server's defaults: opencv, at most 32 frames), as
the gateway's intake hands them on. (a) vLLM given them raw: its HF
processor, its tower, its positions. (b) Prism's encoder
(vision_encoder/towers/qwen_video.py) on the same frames, its tokens handed over
by llm_engine/videos.py. Equal greedy tokens and equal prompt-token counts
show the tokens, the grid and the time axis (Qwen2.5-VL's
second_per_grid_ts, Qwen3-VL's timestamps) all arrived; the tower's output
is also compared with vLLM's own tower (`model.visual`) on the same pixels.

The clips (testing/video_clips.py) span lengths, frame rates, sizes, a
portrait one, an odd frame count, one the loader samples down from 60 frames
to 32, one sampled to a single frame, and two videos in one prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_engine.videos import VideoEmbeds, video_data
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.tiny_models import ensure_tiny_model
from testing.video_clips import CLIPS, load_parity_clips, server_loader
from vision_encoder.towers.qwen_video import QwenVideo, VideoClip, VideoSampling
from vision_encoder.towers.tower import TowerImage
from vision_encoder.towers import load_tower

FAMILIES = {"Qwen2-VL": None, "Qwen2.5-VL": "qwen2.5-vl", "Qwen3-VL": "qwen3-vl"}
MAX_TOKENS = 12
# float32 on both sides: vLLM's tower and transformers' part in the last bits only (the
# answers' log-probabilities by under 1e-6), while a wrong time axis moves them by 1e-4 and more
LOGPROB_TOLERANCE = 1e-5
# HF's Qwen3-VL video processor refuses fewer frames than one temporal patch (as vLLM's path does)
ONE_FRAME_REFUSED = {"Qwen3-VL"}


def checkpoint(family: str) -> Path:
    name = FAMILIES[family]
    return ensure_demo_model(RANDOM_MODEL) if name is None else ensure_tiny_model(name)


@pytest.fixture(scope="module")
def clips():
    return load_parity_clips()


@pytest.fixture(scope="module", params=list(FAMILIES))
def engine(request):
    """vLLM with its vision tower (raw videos) and embeddings input, in this process: the
    variable stays set while the engine is made, used and let go, and is unset after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        path = checkpoint(request.param)
        llm = LLM(str(path), dtype="float32", max_model_len=4096, limit_mm_per_prompt={"image": 1, "video": 2},
                  enable_mm_embeds=True, kv_cache_memory_bytes=128 * 2**20, enforce_eager=True, seed=0)
        video = QwenVideo(load_tower(str(path), "float32", "cpu"))
        yield request.param, llm, video
        del llm


def prompt_for(llm, videos: int, parts: list[dict] | None = None) -> str:
    parts = parts or [{"type": "video"}] * videos
    content = parts + [{"type": "text", "text": "What moves, and what colour is it?"}]
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    prompt_tokens: int
    logprobs: list[float]  # each chosen token's: a random model's greedy text alone barely depends on the video

    def matches(self, other: "Answer") -> bool:
        return (self.token_ids, self.prompt_tokens) == (other.token_ids, other.prompt_tokens) and all(
            abs(a - b) < LOGPROB_TOLERANCE for a, b in zip(self.logprobs, other.logprobs))


def generate(llm, prompt: str, videos, processor_kwargs: dict | None = None, image=None) -> Answer:
    request = {"prompt": prompt, "multi_modal_data": {"video": videos}}
    if image is not None:
        request["multi_modal_data"]["image"] = image
    if processor_kwargs:
        request["mm_processor_kwargs"] = processor_kwargs
    return generate_all(llm, [request])[0]


def generate_all(llm, requests: list[dict]) -> list[Answer]:
    """One engine run: the requests are scheduled together, as concurrent ones are."""
    from vllm import SamplingParams

    outputs = llm.generate(requests, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1), use_tqdm=False)
    return [answer_of(output) for output in outputs]


def answer_of(output) -> Answer:
    completion = output.outputs[0]
    logprobs = [position[token].logprob for token, position in zip(completion.token_ids, completion.logprobs)]
    return Answer(list(completion.token_ids), len(output.prompt_token_ids), logprobs)


def prism_embeds(video: QwenVideo, loaded, sampling: VideoSampling = VideoSampling()) -> VideoEmbeds:
    tokens = video.encode_clip(VideoClip.from_metadata(*loaded), sampling)
    return VideoEmbeds(tokens.tokens, tokens.grid_thw, tokens.second_per_grid_t, tokens.timestamps)


@pytest.mark.parametrize("name", list(CLIPS))
def test_one_video_matches_vllm(engine, clips, name):
    family, llm, video = engine
    prompt = prompt_for(llm, 1)
    if name == "one-frame" and family in ONE_FRAME_REFUSED:
        with pytest.raises(ValueError, match="Failed to apply Qwen3VLProcessor"):
            generate(llm, prompt, [clips[name]])
        with pytest.raises(ValueError, match="temporal_factor"):
            video.encode_clip(VideoClip.from_metadata(*clips[name]))
        with pytest.raises(ValueError, match="temporal_factor"):  # the encoder's check, before a batch would fail
            video.time_axis(VideoClip.from_metadata(*clips[name]))
        return
    raw = generate(llm, prompt, [clips[name]])
    embeds = prism_embeds(video, clips[name])
    ours = generate(llm, prompt, video_data([embeds], family))
    assert ours.matches(raw), (family, name, ours, raw)


# The request's processor knobs (vLLM's mm_processor_kwargs), each family's way of sampling included
KNOBS = {
    "fps-1": {"do_sample_frames": True, "fps": 1.0},
    "num-frames-4": {"do_sample_frames": True, "num_frames": 4},
    "pixel-budget": {"max_pixels": 8 * 28 * 28},
}
# Qwen2-VL's processor is given no metadata by vLLM: it cannot sample by fps, and both refuse
REFUSED = {("Qwen2-VL", "fps-1")}


@pytest.mark.parametrize("knob", list(KNOBS))
def test_sampling_and_pixel_knobs_match_vllm(engine, clips, knob):
    """On a clip the loader kept whole: the processor samples only such clips (vLLM
    fails on a clip its loader sampled already: the indices run past its frames)."""
    family, llm, video = engine
    kwargs, clip = KNOBS[knob], clips["six-seconds"]
    prompt = prompt_for(llm, 1)
    if (family, knob) in REFUSED:
        with pytest.raises(ValueError, match="Failed to apply Qwen2VLProcessor"):
            generate(llm, prompt, [clip], kwargs)
        with pytest.raises(ValueError, match="metadata"):
            prism_embeds(video, clip, VideoSampling(**kwargs))
        return
    raw = generate(llm, prompt, [clip], kwargs)
    embeds = prism_embeds(video, clip, VideoSampling(**kwargs))
    assert embeds.grid_thw != prism_embeds(video, clip).grid_thw  # the knob changed what the tower saw
    ours = generate(llm, prompt, video_data([embeds], family))
    assert ours.matches(raw), (family, knob, ours, raw)


@pytest.mark.parametrize("name", [n for n in CLIPS if n != "one-frame"])
def test_clips_as_vllm_s_server_loads_them_match_vllm(engine, name):
    """The frames vLLM's server would sample for this checkpoint (its loader by video
    processor: Qwen2/2.5-VL's and Qwen3-VL's own, at 2 fps), the gateway's to match."""
    family, llm, video = engine
    loaded = server_clips(video)[name]
    prompt = prompt_for(llm, 1)
    raw = generate(llm, prompt, [loaded])
    ours = generate(llm, prompt, video_data([prism_embeds(video, loaded)], family))
    assert ours.matches(raw), (family, name, ours, raw)


_SERVER_CLIPS: dict[str, dict] = {}


def server_clips(video: QwenVideo) -> dict:
    model = video.tower.model_id
    if model not in _SERVER_CLIPS:
        _SERVER_CLIPS[model] = load_parity_clips(server_loader(model))
    return _SERVER_CLIPS[model]


def test_two_videos_in_one_prompt_match_vllm(engine, clips):
    family, llm, video = engine
    names = ["long", "portrait"]
    prompt = prompt_for(llm, 2)
    raw = generate(llm, prompt, [clips[n] for n in names])
    ours = generate(llm, prompt, video_data([prism_embeds(video, clips[n]) for n in names], family))
    assert ours.matches(raw), (family, ours, raw)


def test_two_videos_and_an_image_in_one_prompt_match_vllm(engine, clips):
    from PIL import Image

    family, llm, video = engine
    tower = video.tower
    picture = np.ascontiguousarray(clips["portrait"][0][3])  # a frame of another clip, as a still
    ((image_tokens, image_grid),) = tower.encode(tower.preprocess([TowerImage(picture, picture.shape[:2])]))
    image_embeds = {"image_embeds": image_tokens, "image_grid_thw": torch.tensor([image_grid])}
    prompt = prompt_for(llm, 2, [{"type": "video"}, {"type": "image"}, {"type": "video"}])
    raw = generate(llm, prompt, [clips["short"], clips["odd"]], image=[Image.fromarray(picture)])
    videos = video_data([prism_embeds(video, clips[n]) for n in ("short", "odd")], family)
    ours = generate(llm, prompt, videos, image=image_embeds)
    assert ours.matches(raw), (family, ours, raw)


def test_eight_concurrent_requests_of_mixed_lengths_match_vllm(engine, clips):
    family, llm, video = engine
    names = [n for n in CLIPS if not (n == "one-frame" and family in ONE_FRAME_REFUSED)]
    names = (names * 2)[:8]
    prompt = prompt_for(llm, 1)
    raw = generate_all(llm, [{"prompt": prompt, "multi_modal_data": {"video": [clips[n]]}} for n in names])
    ours = generate_all(llm, [{"prompt": prompt, "multi_modal_data": {"video": video_data([prism_embeds(video, clips[n])], family)}}
                              for n in names])
    assert all(o.matches(r) for o, r in zip(ours, raw)), (family, names, ours, raw)
    assert len({r.prompt_tokens for r in raw}) > 1  # mixed lengths, so a mix-up would show


def test_the_tower_matches_vllm_s_own_tower(engine, clips):
    """Prism's video tokens against vLLM's own `model.visual` on the same frames. vLLM
    (`mm_device_do_normalize`, on by default for Qwen) asks the processor for unscaled
    pixels and rescales and normalises them in the tower: it is handed those here."""
    _, llm, video = engine
    clip = VideoClip.from_metadata(*clips["odd"])
    ours = video.encode_clip(clip).tokens
    raw = video.processor(videos=[clip.frames], video_metadata=[clip.hf_metadata()], return_tensors="pt",
                          do_rescale=False, do_normalize=False, **video._kwargs(clip, VideoSampling()))
    pixels, grid = raw["pixel_values_videos"], raw["video_grid_thw"]

    def run_visual(model):
        with torch.inference_mode():
            out = model.visual(pixels, grid_thw=grid.tolist())
            return (torch.cat([out[0], *out[1]], dim=-1) if isinstance(out, tuple) else out).cpu()

    (theirs,) = llm.apply_model(run_visual)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_the_time_axis_is_carried_and_matters(engine, clips):
    """The time metadata is not decoration: sent wrong, vLLM places the tokens elsewhere
    (Qwen2.5-VL: M-RoPE's time axis; Qwen3-VL: the prompt's timestamps, and so its length),
    and the answer's log-probabilities move."""
    family, llm, video = engine
    if family == "Qwen2-VL":
        pytest.skip("Qwen2-VL's positions count temporal patches only: it has no time metadata")
    embeds = prism_embeds(video, clips["long"])
    if family == "Qwen2.5-VL":
        wrong = VideoEmbeds(embeds.tokens, embeds.grid_thw, embeds.second_per_grid_t * 8, None)
    else:
        wrong = VideoEmbeds(embeds.tokens, embeds.grid_thw, None, tuple(t + 100 for t in embeds.timestamps))
    prompt = prompt_for(llm, 1)
    right, moved = generate(llm, prompt, video_data([embeds], family)), generate(llm, prompt, video_data([wrong], family))
    assert right.matches(generate(llm, prompt, [clips["long"]]))
    assert not moved.matches(right), (right, moved)
