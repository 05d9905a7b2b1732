"""loadtest.clips: deterministic, decodable clips of the size, rate and length asked for."""

import io

import cv2
import pytest

from loadtest.clips import NAMED, ClipSpec, clip, make_clip, named_clip


def _probe(data: bytes) -> tuple[int, float, int, int]:
    cap = cv2.VideoCapture(io.BytesIO(data), cv2.CAP_FFMPEG, [])
    assert cap.isOpened()
    return (int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), cap.get(cv2.CAP_PROP_FPS),
            int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)))


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_clip_has_the_frames_rate_and_size_it_names(name):
    spec = NAMED[name]
    assert _probe(named_clip(name)) == (spec.num_frames, spec.fps, spec.width, spec.height)


def test_same_seed_same_bytes_other_seed_other_bytes():
    assert clip(seed=3, num_frames=5) == clip(seed=3, num_frames=5)
    assert clip(seed=3, num_frames=5) != clip(seed=4, num_frames=5)


def test_duration_sets_the_frame_count():
    assert _probe(clip(fps=4.0, duration_s=2.5))[0] == 10


def test_the_shape_moves_between_first_and_last_frame():
    cap = cv2.VideoCapture(io.BytesIO(make_clip(ClipSpec(num_frames=6))), cv2.CAP_FFMPEG, [])
    frames = [cap.read()[1] for _ in range(6)]
    assert abs(frames[0].astype(int) - frames[-1].astype(int)).mean() > 1.0


def test_bad_specs_name_the_field():
    with pytest.raises(ValueError, match="num_frames"):
        ClipSpec(num_frames=0)
    with pytest.raises(ValueError, match="fps"):
        ClipSpec(fps=0)
