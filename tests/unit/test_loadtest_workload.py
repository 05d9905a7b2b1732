"""The load tester's workload generator: weights, repeats and seeds honoured, for images and clips."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from loadtest.client import Target, chat_body
from loadtest.videos import LENGTHS, VideoMix, parse_lengths
from loadtest.workload import (Bucket, ImageSpec, RequestSpec, WorkloadSpec, data_url, generate, parse_buckets,
                               parse_distribution, render)

TWO_BUCKETS = (Bucket("big", 64, 48, 3.0), Bucket("small", 32, 32, 1.0))


def repeated_share(requests) -> float:
    seen, repeats, slots = set(), 0, 0
    for request in requests:
        for image in request.images:
            repeats += image in seen
            slots += 1
            seen.add(image)
    return repeats / slots


def test_bucket_weights_are_honoured():
    requests = generate(WorkloadSpec(TWO_BUCKETS, seed=1), 4000)
    share = Counter(r.bucket for r in requests)["big"] / len(requests)
    assert share == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.9])
def test_the_repeat_ratio_is_honoured(ratio):
    requests = generate(WorkloadSpec(TWO_BUCKETS, repeat_ratio=ratio, pool_size=8, seed=2), 4000)
    assert repeated_share(requests) == pytest.approx(ratio, abs=0.03)


def test_repeats_come_from_the_recent_pool():
    requests = generate(WorkloadSpec(TWO_BUCKETS, repeat_ratio=0.5, pool_size=4, seed=3), 500)
    recent: list[ImageSpec] = []
    for request in requests:
        (image,) = request.images
        if image in set(recent) | {i for r in requests[: request.index] for i in r.images}:
            assert image in recent, "a repeat must be one of the last pool_size new images"
        else:
            recent = (recent + [image])[-4:]


def test_images_per_request_follow_their_distribution():
    spec = WorkloadSpec(TWO_BUCKETS, images_per_request=parse_distribution("0=1,2=1"), seed=4)
    counts = Counter(len(r.images) for r in generate(spec, 4000))
    assert set(counts) == {0, 2} and counts[2] / 4000 == pytest.approx(0.5, abs=0.03)
    assert all(r.bucket == "text" for r in generate(spec, 50) if not r.images)


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    spec = WorkloadSpec(TWO_BUCKETS, repeat_ratio=0.3, png_fraction=0.5, prompt_words=5, system_prompts="unique", seed=7)
    assert generate(spec, 200) == generate(spec, 200)
    other = WorkloadSpec(TWO_BUCKETS, repeat_ratio=0.3, png_fraction=0.5, prompt_words=5, system_prompts="unique", seed=8)
    assert generate(other, 200) != generate(spec, 200)


def test_one_image_many_questions_and_system_prompts():
    spec = WorkloadSpec(TWO_BUCKETS, repeat_ratio=1.0, pool_size=1, system_prompts="unique", seed=5)
    requests = generate(spec, 40)
    assert len({r.images for r in requests}) == 1
    assert len({r.system for r in requests}) == 40 and len({r.question for r in requests}) > 1


def test_png_fraction_and_prompt_words():
    requests = generate(WorkloadSpec(TWO_BUCKETS, png_fraction=0.3, prompt_words=6, seed=6), 2000)
    png = sum(r.images[0].fmt == "PNG" for r in requests) / 2000
    assert png == pytest.approx(0.3, abs=0.03)
    assert all(len(r.question.split()) >= 6 + 3 for r in requests)


def test_distinct_images_render_to_distinct_bytes():
    # 123 and 132 have the same digit sum: make_image's own name seeding collides on them.
    specs = [ImageSpec("small", 32, 32, fmt, seed) for fmt in ("JPEG", "PNG") for seed in (123, 132)]
    rendered = render([RequestSpec(0, tuple(specs), "q", None, 4)])
    assert len(set(rendered.values())) == 4
    assert rendered[specs[2]].startswith(b"\x89PNG") and rendered[specs[0]].startswith(b"\xff\xd8")


def test_bucket_and_distribution_parsing():
    buckets = parse_buckets("720p=2, 640x480, 4k=0.5")
    assert [(b.name, b.width, b.height, b.weight) for b in buckets] == [
        ("720p", 1280, 720, 2.0), ("640x480", 640, 480, 1.0), ("4k", 3840, 2160, 0.5)]
    with pytest.raises(ValueError, match="unknown resolution"):
        parse_buckets("8k=1")
    with pytest.raises(ValueError):
        WorkloadSpec(parse_buckets("720p=0"))
    with pytest.raises(ValueError):
        WorkloadSpec(TWO_BUCKETS, repeat_ratio=1.5)


def test_an_image_salt_keeps_the_sizes_and_repeats_and_changes_every_image():
    spec = WorkloadSpec(TWO_BUCKETS, repeat_ratio=0.5, png_fraction=0.3, images_per_request=((1, 0.5), (2, 0.5)), seed=9)
    plain, salted = generate(spec, 200), generate(dataclasses.replace(spec, image_salt=1 << 48), 200)

    def shape(requests):  # sizes and formats in order, and which image repeats which
        first_seen: dict[int, int] = {}
        return [(i.bucket, i.fmt, first_seen.setdefault(i.seed, len(first_seen))) for r in requests for i in r.images]

    assert shape(plain) == shape(salted)
    assert not {i.seed for r in plain for i in r.images} & {i.seed for r in salted for i in r.images}


VIDEO_MIX = VideoMix(parse_lengths("short=3,10s=1"), fraction=0.5, repeat_ratio=0.4, pool_size=4, width=64, height=48,
                     source_fps=4.0, sample_fps=2.0, max_pixels=50_176)


def test_a_video_mix_sends_its_share_of_clips_with_their_lengths_and_repeats():
    requests = generate(WorkloadSpec(TWO_BUCKETS, videos=VIDEO_MIX, seed=12), 4000)
    with_video = [r for r in requests if r.videos]
    assert len(with_video) / 4000 == pytest.approx(0.5, abs=0.03)
    assert all(not r.images and len(r.videos) == 1 for r in with_video)
    assert all(r.images and r.video_fps is None and r.video_max_pixels is None for r in requests if not r.videos)
    new = [r.videos[0] for r in with_video if not r.video_repeat]
    assert sum(v.length == "short" for v in new) / len(new) == pytest.approx(0.75, abs=0.04)
    assert {(v.length, v.duration_s) for v in new} == {("short", LENGTHS["short"]), ("10s", 10.0)}
    assert sum(r.video_repeat for r in with_video) / len(with_video) == pytest.approx(0.4, abs=0.03)


def test_a_repeated_clip_is_a_recent_one_and_a_new_clip_is_new():
    requests = generate(WorkloadSpec(TWO_BUCKETS, videos=VIDEO_MIX, seed=13), 600)
    recent: list = []
    for request in (r for r in requests if r.videos):
        (video,) = request.videos
        if request.video_repeat:
            assert video in recent, "a repeat is one of the last pool_size new clips"
        else:
            assert video not in recent
            recent = (recent + [video])[-4:]


def test_video_requests_are_named_by_length_and_newness_and_carry_the_sampling():
    requests = generate(WorkloadSpec(TWO_BUCKETS, videos=VIDEO_MIX, seed=14), 300)
    kinds = Counter(r.bucket for r in requests)
    assert {"video-short-new", "video-short-repeat", "video-10s-new", "big", "small"} <= set(kinds)
    video = next(r for r in requests if r.videos)
    assert (video.video_fps, video.video_max_pixels) == (2.0, 50_176)
    body = chat_body(Target("http://x", "m"), video, ["data:video/mp4;base64,AAAA"])
    assert body["messages"][-1]["content"][0] == {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    assert body["media_io_kwargs"] == {"video": {"fps": 2.0}} and body["mm_processor_kwargs"] == {"max_pixels": 50_176}


def test_a_spec_without_videos_draws_what_it_drew_before_and_videos_render_as_mp4():
    # seeds drawn by the generator before videos existed: benchmarks re-run on old seeds send the same images
    plain = generate(WorkloadSpec(TWO_BUCKETS, repeat_ratio=0.3, seed=15), 100)
    assert [r.images[0].seed for r in plain[:3]] + [plain[-1].images[0].seed] == [
        256990046815618, 103384156992748, 64348678957463, 221647654418455]
    request = next(r for r in generate(WorkloadSpec(TWO_BUCKETS, videos=VIDEO_MIX, seed=16), 50) if r.videos)
    data = render([request])[request.videos[0]]
    assert data[4:8] == b"ftyp"  # an mp4
    assert data_url(request.videos[0], data).startswith("data:video/mp4;base64,")


def test_video_lengths_and_mixes_are_checked():
    assert [(v.name, v.duration_s, v.weight) for v in parse_lengths("long, 60s=2, 2.5s=0.5")] == [
        ("long", LENGTHS["long"], 1.0), ("60s", 60.0, 2.0), ("2.5s", 2.5, 0.5)]
    for bad in ("forever=1", "0s=1", "-3s", "tens"):
        with pytest.raises(ValueError, match="unknown video length"):
            parse_lengths(bad)
    with pytest.raises(ValueError):
        VideoMix(parse_lengths("short=0"))
    with pytest.raises(ValueError):
        dataclasses.replace(VIDEO_MIX, repeat_ratio=2)
    with pytest.raises(ValueError):
        dataclasses.replace(VIDEO_MIX, width=8)


def test_requests_whose_every_image_is_a_repeat_are_a_kind_of_their_own():
    """A cache hit's TTFT is not a new image's: `<bucket>-repeat` rows apart; a request with one new
    image among repeats is its bucket's."""
    spec = WorkloadSpec(TWO_BUCKETS, images_per_request=parse_distribution("1=1,2=1"), repeat_ratio=0.5, pool_size=4, seed=5)
    requests = generate(spec, 400)
    for request in requests:
        assert request.bucket.endswith("-repeat") == request.images_repeated
    assert {r.bucket for r in requests} == {b.name for b in TWO_BUCKETS} | {f"{b.name}-repeat" for b in TWO_BUCKETS}
    pool_seen, mixed = set(), 0
    for request in requests:
        seeds = [image.seed for image in request.images]
        assert request.images_repeated == all(seed in pool_seen for seed in seeds)
        mixed += any(seed in pool_seen for seed in seeds) and not request.images_repeated
        pool_seen.update(seeds)
    assert mixed > 0
