"""Messages into the gateway (replies from the encoder and the engine).

Every service measures its own durations with a monotonic clock and reports
them here, so the gateway's per-stage breakdown holds across hosts.
"""

from __future__ import annotations

import msgspec

from protocol.base import Message, WrongProtocol
from protocol.stats import EncoderStats, EngineStats
from protocol.tensors import ArrayMeta
from protocol.timings import EncoderTimings
from protocol.video import VideosEncodeResult


class VideoSizing(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How the encoder's video processor sizes a clip's frames (Qwen's families),
    so the gateway sends frames already at that size (the processor's resize is
    then a no-op) and counts a video's tokens before it is decoded."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # the processor's size["shortest_edge"], the deployment's budget applied
    max_pixels: int  # its size["longest_edge"]: per frame, or over the clip where `budget_over_frames`
    budget_over_frames: bool  # Qwen3-VL's smart_resize counts T × H × W
    cap_pixels_per_frame: bool  # transformers' per-frame share of `max_video_tokens`
    max_video_tokens: int
    # The processor samples again a clip whose every frame was kept (Qwen3-VL,
    # as vLLM calls it): its frame count, and so its size, is its own then.
    resamples_whole_clips: bool


class ProcessorInfo(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="qwen"):
    """What the gateway needs to downscale exactly as the encoder's processor
    would (Qwen's families: a pixel budget, sides a multiple of patch × merge)."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    # The checkpoint's video processor class: vLLM's server picks the video
    # loader (which frames are kept) by it, so the gateway samples as it would.
    video_processor: str = ""
    video_sizing: VideoSizing | None = None  # None: frames travel as decoded, their tokens counted from the encoder's answer


class AnyresInfo(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="anyres"):
    """LLaVA-OneVision's and LLaVA-NeXT's tiling (common/anyres.py): the gateway scales an image no
    further down than the tiles would hold it, and counts its tokens."""

    tile_size: int
    patch_size: int
    grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width)
    max_tiles: int | None  # OneVision's anyres_max_N; None: LLaVA-NeXT, no shrink


class TilesInfo(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="tiles"):
    """InternVL's tiles (common/tiles.py), for the same two purposes."""

    tile_size: int
    min_tiles: int
    max_tiles: int
    crop: bool
    tokens_per_tile: int


class EncoderReady(Message):
    model: str
    fingerprint: str  # model identity + preprocessing parameters, as hashed into the cache key
    processor: ProcessorInfo | AnyresInfo | TilesInfo
    boot_id: str = ""  # the answering process's, as its heartbeats carry it ("": not said)
    vision_weights: str = ""  # its checkpoint's (common/checkpoint.py): its engines' must be the same


class EncodedImage(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An image's visual tokens, by reference: the engine fetches the tensor
    from this encoder by `key` (no frame comes back to the gateway)."""

    embeddings: ArrayMeta  # what the tensor is
    grid_thw: tuple[int, int, int] | None  # Qwen's families; None where the family has no grid
    cache_hit: bool
    key: bytes  # the content key (encoder fingerprint + the gateway's digest), never truncated
    identity: bytes  # what the key was hashed from (fingerprint + digest): checked on every fetch
    pushed: bool = False  # sent to the request's engine (EncodeRequest.push_to) already: not held for a fetch


class EncodeResult(Message):
    request_id: str
    images: list[EncodedImage]
    timings: EncoderTimings


class EncodeNeedsPixels(Message):
    """Some images (or videos: EncodeVideos) sent without pixels were not in the cache: send these again with pixels."""

    request_id: str
    indices: list[int]
    cache_lookup_s: float
    total_s: float


class EncodeFailed(Message):
    request_id: str
    message: str
    status: int = 500  # 429 when the encoder's queue is full, 400 for bad pixels, 503 when stalled
    code: str | None = None  # OpenAI error code (None: by status)


class EngineReady(Message):
    model: str
    max_model_len: int
    takes_images: bool = True  # False: a text-only model, served with no encoder
    takes_pushes: bool = False  # its LRU keeps visual tokens an encoder pushes unasked (PushedEmbedding)
    # Images it takes in one prompt (engine.max_images_per_prompt, for a family vLLM runs with its tower);
    # None: no limit of its own. The gateway refuses more before fetching any.
    max_images: int | None = None
    boot_id: str = ""  # the answering process's, as its heartbeats carry it ("": not said)
    vision_weights: str = ""  # its checkpoint's (common/checkpoint.py); "": a text-only model, or not read
    # engine.scheduling_policy: under "fcfs" the gateway refuses a request's priority before its intake
    scheduling_policy: str = "fcfs"
    # What its parsers do, so the gateway refuses before its intake what they cannot: end a reasoning at
    # `thinking_token_budget` (a reasoning parser with an end marker), and keep special tokens in the text of
    # a request with no tools in play (vLLM's qwen3 reasoning parser does), which `spaces_between_special_tokens` spaces.
    budgets_thinking: bool = False
    keeps_special_tokens: bool = False


class EngineTimings(msgspec.Struct, array_like=True, frozen=True, gc=False):
    engine_queue_s: float  # request received by the engine → first scheduled by vLLM, less embed_fetch_s
    prefill_s: float  # first scheduled → first token
    decode_s: float  # first token → last token (0 until finished)
    embed_fetch_s: float = 0.0  # visual tokens fetched from encoders (part of the gateway's embed_transfer)


class TopLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    token: str
    logprob: float
    bytes: list[int]


class PromptLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One entry of a prompt position's logprobs, as vLLM gives them (`prompt_logprobs`)."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One sampled token, in OpenAI's chat logprobs shape."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []


class ToolCallDelta(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """A piece of a tool call as OpenAI streams it: id and name first, then
    argument text; pieces with the same index concatenate."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class ChoiceDelta(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    index: int  # which of the request's n choices
    # content (tool-call markup parsed out); "" where vLLM's server sends `content: ""` (a token whose text is
    # not whole yet, or held for a stop string), None where it sends none (a parser's, holding markup back)
    text: str | None = None
    finish_reason: str | None = None  # set on the choice's last delta
    logprobs: list[TokenLogprob] | None = None  # None: not asked for
    tool_calls: list[ToolCallDelta] = []
    reasoning: str = ""
    tokens: int = 0  # tokens this choice made since its last delta
    stop_reason: int | str | None = None  # with finish_reason "stop": the stop string or token id that ended it
    # This choice's reasoning tokens so far, where the engine counts them (engine.reasoning_parser):
    # on its last delta, and on every delta of a stream whose usage is continuous. None: not counted here.
    reasoning_tokens: int | None = None
    token_ids: list[int] | None = None  # the tokens this delta made, where the request asked (vLLM's return_token_ids)


class TokenDelta(Message):
    request_id: str
    choices: list[ChoiceDelta]
    completion_tokens: int  # cumulative, all choices together
    prompt_tokens: int
    finished: bool = False  # every choice has finished
    timings: EngineTimings | None = None  # on the first delta and the last
    cached_tokens: int = 0  # prompt tokens vLLM found in its prefix cache
    # On the first delta, where the request asked (vLLM's return_token_ids): the prompt as vLLM
    # ran it, every image's and video's placeholder expanded to its rows.
    prompt_token_ids: list[int] | None = None
    # On the first delta, where the request asked (vLLM's prompt_logprobs): each prompt position's
    # entries (None for the first, which nothing predicts).
    prompt_logprobs: list[list[PromptLogprob] | None] | None = None
    prompt_text: str | None = None  # on the first delta, where the request asked (vLLM's return_prompt_text): the chat template's text


class GenerateFailed(Message):
    request_id: str
    message: str
    status: int = 500  # 400 when the request itself was at fault
    code: str | None = None  # OpenAI error code, e.g. engine_dead, engine_stalled (None: by status)
    param: str | None = None  # the request's field at fault (a 400's), as OpenAI's errors name it


# GenerateFailed's code when the engine could not fetch an image's visual
# tokens (llm_engine/images.py): the gateway encodes the images again, once.
EMBEDDINGS_UNAVAILABLE = "embeddings_unavailable"

# GenerateFailed's code when the engine gave up on a stream because its gateway
# did not read (its queue stayed full past the router's full_peer_wait_s).
STREAM_DROPPED = "stream_dropped"


GatewayInbound = (EncoderReady | EncodeResult | VideosEncodeResult | EncodeNeedsPixels | EncodeFailed | EngineReady | TokenDelta
                  | GenerateFailed | EncoderStats | EngineStats | WrongProtocol)
