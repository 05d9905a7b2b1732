"""Images and videos in one forward of the tower (batched by patch budget) give
each item the tokens it gets alone, for the three Qwen families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loadtest.clips import ClipSpec, make_clip
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.tiny_models import ensure_tiny_model
from testing.video_clips import vllm_loaded
from vision_encoder.towers.qwen_video import QwenVideo, VideoClip, join
from vision_encoder.towers.tower import TowerImage
from vision_encoder.towers import load_tower


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_an_image_and_two_videos_in_one_forward_match_each_alone(family):
    path = ensure_demo_model(RANDOM_MODEL) if family == "qwen2-vl" else ensure_tiny_model(family)
    video = QwenVideo(load_tower(str(path), "float32", "cpu"))
    tower = video.tower
    clips = [VideoClip.from_metadata(*vllm_loaded(make_clip(spec))) for spec in
             (ClipSpec(160, 120, 4.0, 8, seed=1), ClipSpec(96, 176, 10.0, 7, seed=2))]
    picture = np.ascontiguousarray(clips[0].frames[2])
    image = tower.preprocess([TowerImage(picture, picture.shape[:2])])
    videos = [video.preprocess(clip) for clip in clips]
    together = tower.encode(join(tower, [videos[0].batch, image, videos[1].batch]))
    alone = [video.encode(videos[0]).tokens, tower.encode(image)[0][0], video.encode(videos[1]).tokens]
    assert [grid for _, grid in together] == [tuple(videos[0].batch.grid_thw[0].tolist()), tuple(image.grid_thw[0].tolist()),
                                              tuple(videos[1].batch.grid_thw[0].tolist())]
    for (tokens, _), expected in zip(together, alone):
        torch.testing.assert_close(tokens, expected, rtol=1e-5, atol=1e-5)


def test_a_family_without_a_video_path_is_named():
    from vision_encoder.towers.qwen_video import video_path_of

    tower = load_tower(str(ensure_tiny_model("llava-onevision")), "float32", "cpu")
    with pytest.raises(ValueError, match="LLaVA-OneVision videos are not supported"):
        video_path_of(tower)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_the_encoders_handshake_leads_the_gateway_to_the_loader_vllms_server_picks(family):
    from gateway.api.videos import video_loader
    from testing.video_clips import server_loader

    path = ensure_demo_model(RANDOM_MODEL) if family == "qwen2-vl" else ensure_tiny_model(family)
    info = load_tower(str(path), "float32", "cpu").processor_info
    assert video_loader(info, "m", "messages[0].content[0]") == server_loader(str(path))
