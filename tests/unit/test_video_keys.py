"""A video's cache key: the same clip with the same parameters gives the same
key; anything that changes the frames or the pixels the tower sees changes it."""

from __future__ import annotations

import json
import shutil

import pytest

from cache import content_key
from cache.video_keys import video_key
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from vision_encoder.towers.qwen_video import QwenVideo, VideoSampling
from vision_encoder.towers import load_tower

DIGEST = content_key({"loader": "opencv", "fps": None, "num_frames": None}, b"the clip's bytes")


@pytest.fixture(scope="module")
def video():
    return QwenVideo(load_tower(str(ensure_demo_model(RANDOM_MODEL)), "float32", "cpu"))


def test_the_same_clip_and_parameters_give_the_same_key(video):
    again = QwenVideo(video.tower)
    assert video.cache_key(DIGEST, VideoSampling(fps=1.0)) == again.cache_key(DIGEST, VideoSampling(fps=1.0))


@pytest.mark.parametrize("sampling", [
    VideoSampling(fps=1.0), VideoSampling(fps=2.0), VideoSampling(num_frames=4), VideoSampling(num_frames=8),
    VideoSampling(do_sample_frames=True), VideoSampling(max_pixels=50_176), VideoSampling(min_pixels=3136),
])
def test_each_request_knob_changes_the_key(video, sampling):
    assert video.cache_key(DIGEST, sampling) != video.cache_key(DIGEST)


def test_every_knob_setting_has_its_own_key(video):
    settings = [VideoSampling(), VideoSampling(fps=1.0), VideoSampling(fps=2.0), VideoSampling(num_frames=4),
                VideoSampling(fps=1.0, max_pixels=50_176), VideoSampling(max_pixels=50_176)]
    assert len({video.cache_key(DIGEST, s) for s in settings}) == len(settings)


def test_the_gateway_s_digest_carries_the_bytes_and_its_loader_s_sampling(video):
    other_bytes = content_key({"loader": "opencv", "fps": None, "num_frames": None}, b"another clip")
    other_loader = content_key({"loader": "opencv", "fps": 1.0, "num_frames": None}, b"the clip's bytes")
    keys = {video.cache_key(d) for d in (DIGEST, other_bytes, other_loader)}
    assert len(keys) == 3


def test_a_video_never_shares_an_image_s_key(video):
    assert video.cache_key(DIGEST) != content_key(video.tower.fingerprint, DIGEST)


def test_the_checkpoint_s_video_processor_defaults_are_in_the_key(video, tmp_path):
    """A checkpoint whose video_preprocessor_config.json sets another pixel budget or fps
    (the image processor and weights unchanged) keys its videos apart."""
    base = video.preprocessing_params()
    for change in ({"max_pixels": 200_704, "size": {"shortest_edge": 3136, "longest_edge": 200_704}}, {"fps": 1.0}):
        copy = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(RANDOM_MODEL, copy)
        config = json.loads((copy / "video_preprocessor_config.json").read_text())
        (copy / "video_preprocessor_config.json").write_text(json.dumps({**config, **change}))
        changed = QwenVideo(load_tower(str(copy), "float32", "cpu"))
        assert changed.preprocessing_params() != base
        # the same fingerprint (the copy's path alone would change it): the video processor's part does it
        assert video_key(video.tower.key_fingerprint, changed.preprocessing_params(), {}, DIGEST, {}) != video.cache_key(DIGEST)
        # and the replica answers the gateway's handshake as another encoder: its frames are sized otherwise
        assert changed.tower.fingerprint == video.tower.fingerprint and changed.fingerprint() != video.fingerprint()


def test_the_key_is_the_documented_hash(video):
    assert video.cache_key(DIGEST) == video_key(video.tower.key_fingerprint, video.preprocessing_params(), {}, DIGEST, {})


def test_the_frames_sent_are_in_the_key(video):
    """A header one frame over its stream: the lookup its header alone makes promises a frame the
    decode that made the tokens could not read."""
    decoded = {"fps": 2.0, "total_num_frames": 7, "duration": 3.5, "frames_indices": list(range(6)), "do_sample_frames": False}
    promised = dict(decoded, frames_indices=list(range(7)))
    assert video.cache_key(DIGEST, VideoSampling(), decoded) != video.cache_key(DIGEST, VideoSampling(), promised)
    assert video.cache_key(DIGEST, VideoSampling(), decoded) == video.cache_key(DIGEST, VideoSampling(), dict(decoded))


def test_the_deployment_s_pixel_budget_is_in_the_key_and_the_processor(video):
    """encoder.max_pixels/min_pixels reach the video processor as vLLM's `mm_processor_kwargs` do:
    a clip keys apart under another budget, and the budget is the processor's size."""
    budgeted = QwenVideo(load_tower(str(ensure_demo_model(RANDOM_MODEL)), "float32", "cpu", min_pixels=3136, max_pixels=200_704))
    assert (budgeted.processor.size.shortest_edge, budgeted.processor.size.longest_edge) == (3136, 200_704)
    assert budgeted.cache_key(DIGEST) != video.cache_key(DIGEST)
    assert budgeted.preprocessing_params()["size"] != video.preprocessing_params()["size"]
