"""Videos reach an engine set up as Prism's is (llm_engine/service.py engine_args):
embeddings enabled, a raw-video limit of 0, so vLLM loads no vision tower
(Qwen2/2.5-VL; Qwen3-VL keeps its tower, unprofiled, for DeepStack), and the
answers equal those of vLLM's raw-video path from a full engine started first.
"""

from __future__ import annotations

import gc

import pytest

from llm_engine.videos import VideoEmbeds, video_data
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.tiny_models import ensure_tiny_model
from testing.video_clips import load_parity_clips
from vision_encoder.towers.qwen_video import QwenVideo, VideoClip
from vision_encoder.towers import load_tower

CHECKPOINTS = {"Qwen2-VL": None, "Qwen2.5-VL": "qwen2.5-vl", "Qwen3-VL": "qwen3-vl"}
NAMES = ["odd", "long", "slow"]
COMMON = dict(dtype="float32", max_model_len=4096, kv_cache_memory_bytes=128 * 2**20, enforce_eager=True, seed=0)


def answers(llm, requests) -> list[tuple[list[int], int, list[float]]]:
    from vllm import SamplingParams

    outputs = llm.generate(requests, SamplingParams(max_tokens=10, temperature=0.0, logprobs=1), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), len(o.prompt_token_ids),
             [p[t].logprob for t, p in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]) for o in outputs]


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def both(request):
    """(raw answers from a full engine, Prism's answers from an embeddings-only one, whether it loaded a tower)."""
    with pytest.MonkeyPatch.context() as mp:  # set while the engines are made, used and let go; unset after
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        name = CHECKPOINTS[request.param]
        path = str(ensure_demo_model(RANDOM_MODEL) if name is None else ensure_tiny_model(name))
        clips = load_parity_clips()
        video = QwenVideo(load_tower(path, "float32", "cpu"))
        embeds = []
        for n in NAMES:
            t = video.encode_clip(VideoClip.from_metadata(*clips[n]))
            embeds.append(VideoEmbeds(t.tokens, t.grid_thw, t.second_per_grid_t, t.timestamps))
        full = LLM(path, limit_mm_per_prompt={"image": 0, "video": 1}, **COMMON)
        content = [{"type": "video"}, {"type": "text", "text": "What moves?"}]
        prompt = full.get_tokenizer().apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        raw = answers(full, [{"prompt": prompt, "multi_modal_data": {"video": [clips[n]]}} for n in NAMES])
        del full
        gc.collect()
        needs_tower = video.tower.family.vllm_needs_tower
        only = LLM(path, enable_mm_embeds=True, limit_mm_per_prompt={"image": 4 if needs_tower else 0, "video": 0},
                   skip_mm_profiling=needs_tower, **COMMON)
        # each video keyed by its cache key, as the engine keys images (vLLM then hashes no tensor)
        ours = answers(only, [{"prompt": prompt, "multi_modal_data": {"video": video_data([e], video.family)},
                               "multi_modal_uuids": {"video": [f"video-{n}-{request.param}"]}} for n, e in zip(NAMES, embeds)])
        tower = only.apply_model(lambda model: type(model.visual).__name__)[0]
        yield request.param, raw, ours, tower
        del only
        gc.collect()


def test_video_embeddings_pass_a_raw_video_limit_of_0_and_match_vllm(both):
    family, raw, ours, _ = both
    for (r_tokens, r_count, r_logprobs), (o_tokens, o_count, o_logprobs) in zip(raw, ours):
        assert (o_tokens, o_count) == (r_tokens, r_count), family
        assert max(abs(a - b) for a, b in zip(r_logprobs, o_logprobs)) < 1e-5, family


def test_no_vision_tower_is_loaded_but_qwen3_vl_s(both):
    family, _, _, tower = both
    assert (tower == "StageMissingLayer") == (family != "Qwen3-VL"), (family, tower)
