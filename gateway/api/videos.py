"""A chat request's videos: each `video_url` part, where it is, and how it is sampled."""

from __future__ import annotations

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.api.schemas import ChatCompletionRequest, VideoPart
from gateway.intake.video.intake import VideoRef
from gateway.intake.video.limits import VideoLimits
from gateway.intake.video.sampling import LoaderKind, SampledVideo, VideoSampling
from protocol.video import VideoKnobs


def video_limits(config: GatewayConfig) -> VideoLimits:
    return VideoLimits(config.max_video_bytes, config.max_video_frame_pixels, config.max_video_frames,
                       config.max_video_duration_s, config.max_video_sampled_frames)


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
    return VideoSampling(loader, given.fps, given.num_frames, given.min_frames, given.max_frames)


def check_count(refs: list[VideoRef], config: GatewayConfig) -> None:
    if len(refs) > config.max_videos_per_request:
        raise APIError(400, f"{len(refs)} videos in one request; the limit is {config.max_videos_per_request} "
                       "(gateway.max_videos_per_request)", param="messages", code="too_many_videos")


async def take_videos(intake, request: ChatCompletionRequest, refs: list[VideoRef], timer, config: GatewayConfig,
                      model_name: str | None, text_only: bool) -> list[SampledVideo]:
    """Every video fetched, checked and decoded (a hostile one is refused with its own 4xx),
    sampled by Qwen2-VL's loader (the demo model's family; vLLM's server picks it for
    Qwen2/2.5-VL checkpoints)."""
    if text_only:
        raise APIError(400, f"{refs[0].where}: model '{model_name}' is served text-only and takes no videos",
                       param=refs[0].where, code="videos_not_supported")
    check_count(refs, config)
    sampling = request_sampling(request, "qwen2_vl")
    return await intake.take_all([(ref, sampling) for ref in refs], timer)


def video_knobs(request: ChatCompletionRequest) -> VideoKnobs:
    """The request's `mm_processor_kwargs` as vLLM hands them to the video processor too (a pixel budget)."""
    given = request.mm_processor_kwargs
    return VideoKnobs() if given is None else VideoKnobs(min_pixels=given.min_pixels, max_pixels=given.max_pixels)
