"""video_url parts and the video sampling knobs at the HTTP edge: parts found
in any turn beside images, knobs validated with errors naming the field."""

from __future__ import annotations

import pydantic
import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.api.parsing import validation_error
from gateway.api.schemas import ChatCompletionRequest
from gateway.api.videos import check_count, request_sampling, video_refs
from gateway.intake.video.sampling import VideoSampling

VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def request(*, media_io_kwargs=None, messages=None) -> ChatCompletionRequest:
    body = {"model": "m", "messages": messages or [{"role": "user", "content": [VIDEO]}]}
    if media_io_kwargs is not None:
        body["media_io_kwargs"] = media_io_kwargs
    return ChatCompletionRequest.model_validate(body)


def refused(**kwargs) -> APIError:
    with pytest.raises(pydantic.ValidationError) as caught:
        request(**kwargs)
    return validation_error(caught.value)


def test_videos_and_images_in_several_turns_are_found_in_order():
    messages = [
        {"role": "user", "content": [VIDEO, {"type": "text", "text": "and"}, IMAGE, VIDEO]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [IMAGE, VIDEO]},
    ]
    refs = video_refs(request(messages=messages))
    assert [r.where for r in refs] == ["messages[0].content[0]", "messages[0].content[3]", "messages[2].content[1]"]


def test_a_video_part_takes_no_unknown_field():
    error = refused(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x", "fps": 3}}]}])
    assert error.status == 400 and error.param.endswith("video_url.fps")


def test_a_tool_message_carries_no_video():
    error = refused(messages=[{"role": "tool", "tool_call_id": "c", "content": [VIDEO]}])
    assert error.status == 400 and "tool message carries text only" in error.message


def test_sampling_defaults_are_the_loaders():
    assert request_sampling(request(), "qwen2_vl") == VideoSampling("qwen2_vl")


def test_sampling_knobs_reach_the_loader():
    r = request(media_io_kwargs={"video": {"fps": 1.5, "min_frames": 2, "max_frames": 8}})
    assert request_sampling(r, "qwen3_vl") == VideoSampling("qwen3_vl", fps=1.5, min_frames=2, max_frames=8)
    assert request_sampling(request(media_io_kwargs={"video": {"num_frames": 8}}), "opencv").num_frames == 8


@pytest.mark.parametrize("knobs, field", [
    ({"fps": 0}, "media_io_kwargs.video.fps"),
    ({"fps": -1}, "media_io_kwargs.video.fps"),
    ({"fps": 1000}, "media_io_kwargs.video.fps"),
    ({"num_frames": 0}, "media_io_kwargs.video.num_frames"),
    ({"min_frames": 0}, "media_io_kwargs.video.min_frames"),
    ({"max_frames": "many"}, "media_io_kwargs.video.max_frames"),
    ({"min_frames": 9, "max_frames": 3}, "media_io_kwargs.video"),
])
def test_bad_knob_values_name_the_field(knobs, field):
    error = refused(media_io_kwargs={"video": knobs})
    assert error.status == 400 and error.param == field


@pytest.mark.parametrize("body, field", [
    ({"video": {"frame_recovery": True}}, "media_io_kwargs.video.frame_recovery"),
    ({"video": {"video_backend": "torchcodec"}}, "media_io_kwargs.video.video_backend"),
    ({"image": {"image_mode": "RGBA"}}, "media_io_kwargs.image"),
])
def test_knobs_prism_does_not_honour_are_400s(body, field):
    error = refused(media_io_kwargs=body)
    assert error.status == 400 and error.param == field


def test_num_frames_is_refused_where_the_loader_would_ignore_it():
    with pytest.raises(APIError) as caught:
        request_sampling(request(media_io_kwargs={"video": {"num_frames": 8}}), "qwen2_vl")
    assert caught.value.status == 400 and caught.value.param == "media_io_kwargs.video.num_frames"


@pytest.mark.parametrize("loader", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("key,value", [("fps", 31), ("min_frames", 769), ("max_frames", 769)])
def test_sampling_past_the_loader_s_cap_is_refused_where_it_would_be_capped_quietly(loader, key, value):
    with pytest.raises(APIError) as caught:
        request_sampling(request(media_io_kwargs={"video": {key: value}}), loader)
    assert caught.value.status == 400 and caught.value.param == f"media_io_kwargs.video.{key}"
    assert request_sampling(request(media_io_kwargs={"video": {key: value}}), "opencv")  # its loader takes them as sent


def test_too_many_videos_names_the_setting():
    refs = video_refs(request(messages=[{"role": "user", "content": [VIDEO] * 3}]))
    with pytest.raises(APIError, match="gateway.max_videos_per_request"):
        check_count(refs, GatewayConfig(max_videos_per_request=2))


def test_a_model_without_a_video_path_refuses_videos_naming_the_part():
    from gateway.api.videos import video_loader
    from protocol.to_gateway import AnyresInfo, ProcessorInfo

    where = "messages[0].content[1]"
    assert video_loader(ProcessorInfo(14, 2, 3136, 65536, "Qwen3VLVideoProcessor"), "m", where) == "qwen3_vl"
    assert video_loader(ProcessorInfo(14, 2, 3136, 65536, "Qwen2VLVideoProcessor"), "m", where) == "qwen2_vl"
    for processor, why in ((None, "text-only"), (ProcessorInfo(14, 2, 3136, 65536), "no video path"),
                           (AnyresInfo(336, 14, ((336, 672),), None), "no video path")):
        with pytest.raises(APIError) as caught:
            video_loader(processor, "m", where)
        assert (caught.value.status, caught.value.param, caught.value.code) == (400, where, "videos_not_supported")
        assert why in caught.value.message
