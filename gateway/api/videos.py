"""A chat request's videos: each `video_url` part, where it is, and how it is sampled."""

from __future__ import annotations

import functools

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.api.schemas import ChatCompletionRequest, VideoPart
from gateway.intake.video.intake import InspectedVideo, VideoRef
from gateway.intake.video.limits import VideoLimits
from gateway.intake.video.sampling import LOADER_OF_PROCESSOR, QWEN_MAX_FPS, QWEN_MAX_FRAMES, LoaderKind, VideoSampling
from gateway.intake.video.sizing import plan_frames
from protocol.to_gateway import ProcessorInfo
from protocol.video import VideoKnobs


def video_limits(config: GatewayConfig) -> VideoLimits:
    return VideoLimits(config.max_video_bytes, config.max_video_frame_pixels, config.max_video_frames,
                       config.max_video_duration_s, config.max_video_sampled_frames, config.max_video_decode_s,
                       config.max_aspect_ratio)


def video_refs(request: ChatCompletionRequest) -> list[VideoRef]:
    """Every video part, in order, in any turn."""
    return [VideoRef(f"messages[{m}].content[{p}]", part.video_url.url)
            for m, message in enumerate(request.messages) if isinstance(message.content, list)
            for p, part in enumerate(message.content) if isinstance(part, VideoPart)]


def request_sampling(request: ChatCompletionRequest, loader: LoaderKind) -> VideoSampling:
    """The loader's arguments for this request's videos (vLLM applies one media_io_kwargs to all)."""
    given = request.media_io_kwargs.video if request.media_io_kwargs and request.media_io_kwargs.video else None
    if given is None:
        return VideoSampling(loader)
    if given.num_frames is not None and loader != "opencv":
        # vLLM's Qwen loaders ignore num_frames: a no-op that would surprise the client
        raise APIError(400, "media_io_kwargs.video.num_frames: this model's video loader samples by fps "
                       "(media_io_kwargs.video.fps, min_frames, max_frames), not by a frame count",
                       param="media_io_kwargs.video.num_frames", code="unsupported_parameter")
    if loader != "opencv":  # vLLM's Qwen loaders cap these quietly: past the cap, a no-op
        for key, value, cap in (("fps", given.fps, QWEN_MAX_FPS), ("min_frames", given.min_frames, QWEN_MAX_FRAMES),
                                ("max_frames", given.max_frames, QWEN_MAX_FRAMES)):
            if value is not None and value > cap:
                raise APIError(400, f"media_io_kwargs.video.{key}: {value:g} is past this model's video loader's "
                               f"cap of {cap}, which it would sample at instead; send at most {cap}",
                               param=f"media_io_kwargs.video.{key}", code="invalid_value")
    return VideoSampling(loader, given.fps, given.num_frames, given.min_frames, given.max_frames)


def check_count(refs: list[VideoRef], config: GatewayConfig) -> None:
    if len(refs) > config.max_videos_per_request:
        raise APIError(400, f"{len(refs)} videos in one request; the limit is {config.max_videos_per_request} "
                       "(gateway.max_videos_per_request)", param="messages", code="too_many_videos")


def takes_videos(processor) -> bool:
    """Whether Prism serves videos for the encoder's processor (its handshake; None: text-only)."""
    return isinstance(processor, ProcessorInfo) and processor.video_processor in LOADER_OF_PROCESSOR


def video_loader(processor, model_name: str | None, where: str) -> LoaderKind:
    """The loader vLLM's server samples this model's videos with, chosen by the
    encoder's video processor (its handshake); a model with none takes no videos."""
    if not takes_videos(processor):
        why = "is served text-only" if processor is None else "has no video path in Prism (Qwen2-VL, Qwen2.5-VL and Qwen3-VL have)"
        raise APIError(400, f"{where}: model '{model_name}' {why} and takes no videos", param=where,
                       code="videos_not_supported")
    return LOADER_OF_PROCESSOR[processor.video_processor]


async def take_videos(intake, request: ChatCompletionRequest, refs: list[VideoRef], timer, config: GatewayConfig,
                      model_name: str | None, processor) -> list[InspectedVideo]:
    """Every video fetched and checked, not yet decoded (a hostile one is refused with its own 4xx),
    sampled by the loader vLLM's server would pick for the model and its frames' size planned
    (`processor`: the encoder's handshake, None for a text-only model)."""
    loader = video_loader(processor, model_name, refs[0].where)
    check_count(refs, config)
    sampling = request_sampling(request, loader)
    planner = functools.partial(plan_frames, processor.video_sizing, video_knobs(request))
    return await intake.take_all([(ref, sampling) for ref in refs], timer, planner, request.cache_salt)


def video_knobs(request: ChatCompletionRequest) -> VideoKnobs:
    """The request's `mm_processor_kwargs` as vLLM hands them to the video processor too (a pixel budget)."""
    given = request.mm_processor_kwargs
    return VideoKnobs() if given is None else VideoKnobs(min_pixels=given.min_pixels, max_pixels=given.max_pixels)
