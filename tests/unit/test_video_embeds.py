"""llm_engine/videos.py: the shapes vLLM's engine core would die on are refused
before it, naming the video; the dict vLLM takes is built as its parsers read it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_engine.videos import InvalidVideo, VideoEmbeds, check_video, embeds_of, video_data
from protocol.tensors import meta_of
from protocol.video import VideoEmbedding, VideoKnobs
from vision_encoder.towers.qwen_video import VideoClip, VideoSampling, calculate_timestamps


def test_rows_must_be_the_grid_s_tokens_and_the_width_the_family_s():
    check_video(VideoEmbeds(torch.zeros(24, 128), (2, 6, 8)), "Qwen2-VL", 128, 2)
    with pytest.raises(InvalidVideo, match=r"videos\[3\].*expected \(24, 128\)"):
        check_video(VideoEmbeds(torch.zeros(23, 128), (2, 6, 8)), "Qwen2-VL", 128, 2, index=3)
    with pytest.raises(InvalidVideo, match=r"expected \(24, 384\)"):
        check_video(VideoEmbeds(torch.zeros(24, 128), (2, 6, 8), timestamps=(0.5, 1.5)), "Qwen3-VL", 384, 2)
    with pytest.raises(InvalidVideo, match="shape"):
        check_video(VideoEmbeds(torch.zeros(1, 24, 128), (2, 6, 8)), "Qwen2-VL", 128, 2)


def test_each_family_s_time_axis_is_required():
    with pytest.raises(InvalidVideo, match="second_per_grid_t"):
        check_video(VideoEmbeds(torch.zeros(24, 128), (2, 6, 8)), "Qwen2.5-VL", 128, 2)
    with pytest.raises(InvalidVideo, match="one timestamp per temporal patch"):
        check_video(VideoEmbeds(torch.zeros(24, 384), (2, 6, 8), timestamps=(0.5,)), "Qwen3-VL", 384, 2)
    check_video(VideoEmbeds(torch.zeros(24, 128), (2, 6, 8), second_per_grid_t=0.5), "Qwen2.5-VL", 128, 2)



@pytest.mark.parametrize("second_per_grid_t,timestamps", [(float("inf"), None), (float("nan"), None), (1e9, None),
                                                          (None, (0.0, float("inf"))), (None, (0.0, 1e9))])
def test_a_time_axis_past_the_model_s_positions_is_refused_before_it_reaches_vllm_s_engine_core(second_per_grid_t, timestamps):
    """It becomes rotary positions there: past the position table, the engine core (and every request on it) dies."""
    family = "Qwen2.5-VL" if timestamps is None else "Qwen3-VL"
    with pytest.raises(InvalidVideo, match="second_per_grid_t|timestamps"):
        check_video(VideoEmbeds(torch.zeros(24, 128), (2, 6, 8), second_per_grid_t, timestamps), family, 128, 2)


def test_videos_are_one_flat_tensor_with_their_grids_and_time_axes():
    a = VideoEmbeds(torch.ones(24, 8), (2, 6, 8), 0.5, (0.25, 1.25))
    b = VideoEmbeds(torch.zeros(4, 8), (1, 4, 4), 2.0, (0.0,))
    qwen2 = video_data([a, b], "Qwen2-VL")
    assert set(qwen2) == {"video_embeds", "video_grid_thw"} and qwen2["video_embeds"].shape == (28, 8)
    assert qwen2["video_grid_thw"].tolist() == [[2, 6, 8], [1, 4, 4]]
    assert video_data([a, b], "Qwen2.5-VL")["second_per_grid_ts"].tolist() == [0.5, 2.0]
    assert video_data([a, b], "Qwen3-VL")["timestamps"] == [[0.25, 1.25], [0.0]]


def test_the_wire_s_video_becomes_the_engine_s():
    tokens = torch.zeros(24, 8)
    wire = VideoEmbedding(meta_of(tokens), (2, 6, 8), None, [0.25, 1.25], b"k" * 16)
    assert embeds_of(wire, tokens) == VideoEmbeds(tokens, (2, 6, 8), None, (0.25, 1.25))
    assert VideoSampling.from_knobs(VideoKnobs(fps=1.0, max_pixels=50_176)) == VideoSampling(fps=1.0, max_pixels=50_176)


def test_qwen3_timestamps_are_the_mean_time_of_each_temporal_patch():
    assert calculate_timestamps([0, 5, 10, 15], 10.0, 2) == [0.25, 1.25]
    assert calculate_timestamps([0, 5, 10], 10.0, 2) == [0.25, 1.0]  # the odd tail repeats its last frame


@pytest.mark.parametrize("frames,indices,fps,total,message", [
    (np.zeros((2, 8, 8, 3), np.float32), (0, 1), 5.0, 2, "uint8"),
    (np.zeros((2, 8, 8), np.uint8), (0, 1), 5.0, 2, "uint8"),
    (np.zeros((0, 8, 8, 3), np.uint8), (), 5.0, 2, "T ≥ 1"),
    (np.zeros((2, 8, 8, 3), np.uint8), (0, 1, 2), 5.0, 3, "3 frames_indices for 2 frames"),
    (np.zeros((2, 8, 8, 3), np.uint8), (0, 1), 0.0, 2, "fps 0.0"),
    (np.zeros((3, 8, 8, 3), np.uint8), (0, 1, 2), 5.0, 2, "total_num_frames 2"),
])
def test_a_clip_that_cannot_be_what_the_loader_gave_is_refused(frames, indices, fps, total, message):
    with pytest.raises(ValueError, match=message):
        VideoClip(frames, fps, total, total / 5.0, indices, True)
