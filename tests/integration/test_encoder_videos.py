"""Videos through a real encoder service in this process (the demo model's
checkpoint, a real ZMQ socket, the gateway's wire messages): a video's
tokens equal its video path's own encode, a repeat is a cache hit, two
requests for one new clip at once encode it once, and a video and an image
sent together ride one batch (qwen_video.join) with each its own tokens, and
a video sent without frames is answered from the cache or asked for."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from loadtest.clips import ClipSpec, make_clip
from protocol.sockets import AsyncDealer
from protocol.tensors import to_frame
from protocol.to_encoder import EncodeRequest, FetchEmbeddings, ImageInput
from protocol.to_engine import FetchInbound
from protocol.to_gateway import EncodeFailed, EncodeNeedsPixels, EncodeResult, GatewayInbound
from protocol.tensors import to_torch
from protocol.video import EncodeVideos, LoaderMetadata, VideoInput, VideoKnobs, VideosEncodeResult
from testing.video_clips import vllm_loaded
from tests.integration.encoder_socket import encoder_in_thread, handshake, replies_to, reply_to, stats_of
from vision_encoder.towers.qwen_video import VideoClip, video_path_of

BATCH_WAIT_MS = 400  # long enough that two messages sent back to back are in one batch


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    address, service = encoder_in_thread(tmp_path_factory.mktemp("encoder-videos"), max_wait_ms=BATCH_WAIT_MS)
    return address, video_path_of(service.tower)


def clip(seed: int) -> tuple[np.ndarray, dict]:
    return vllm_loaded(make_clip(ClipSpec(160, 120, 2.0, 6, seed=seed)), 8)


def video_request(request_id: str, loaded: tuple[np.ndarray, dict], digest: bytes):
    frames, metadata = loaded
    meta, frame = to_frame(frames)
    return EncodeVideos(request_id, [VideoInput(digest, LoaderMetadata(**metadata), frames=meta)]), [frame]


async def fetched(socket: AsyncDealer, address: str, key: bytes, identity: bytes) -> torch.Tensor:
    fetcher = AsyncDealer(zmq.asyncio.Context.instance(), address, FetchInbound)
    await fetcher.send(FetchEmbeddings("f", [key], [identity]))
    answer, frames = await asyncio.wait_for(fetcher.recv(), 30)
    fetcher.close()
    return to_torch(answer.found[0], frames[0])


async def connect(address: str) -> AsyncDealer:
    socket = AsyncDealer(zmq.asyncio.Context.instance(), address, GatewayInbound)
    await handshake(socket)
    return socket


async def encode_twice(address: str, path) -> None:
    socket = await connect(address)
    loaded = clip(1)
    await socket.send(*video_request("v1", loaded, b"\x01" * 16))
    first, _ = await reply_to(socket, "v1", timeout_s=120)
    assert isinstance(first, VideosEncodeResult) and not first.videos[0].cache_hit
    video = first.videos[0]
    expected = path.encode_clip(VideoClip.from_metadata(*loaded))
    assert video.grid_thw == tuple(expected.grid_thw) and video.second_per_grid_t is None and video.timestamps is None
    torch.testing.assert_close(await fetched(socket, address, video.key, video.identity), expected.tokens)
    hits = (await stats_of(socket)).cache_hits
    await socket.send(*video_request("v2", loaded, b"\x01" * 16))
    again, _ = await reply_to(socket, "v2", timeout_s=120)
    assert again.videos[0].cache_hit and again.videos[0].key == video.key
    assert (await stats_of(socket)).cache_hits == hits + 1
    socket.close()


def test_a_video_s_tokens_are_its_own_encode_and_a_repeat_is_a_cache_hit(encoder):
    asyncio.run(encode_twice(*encoder))


def lookup_only(request_id: str, loaded: tuple[np.ndarray, dict], digest: bytes, knobs: VideoKnobs = VideoKnobs()):
    """The gateway's ask for a repeat it has not decoded: the digest and metadata, no frames."""
    return EncodeVideos(request_id, [VideoInput(digest, LoaderMetadata(**loaded[1]), knobs)]), []


async def looked_up(address: str) -> None:
    socket = await connect(address)
    loaded = clip(4)
    misses = (await stats_of(socket)).cache_misses
    await socket.send(*lookup_only("l1", loaded, b"\x04" * 16))
    missing, _ = await reply_to(socket, "l1", timeout_s=120)
    assert isinstance(missing, EncodeNeedsPixels) and missing.indices == [0]  # never encoded: frames wanted
    request, frames = video_request("l2", loaded, b"\x04" * 16)
    await socket.send(msgspec.structs.replace(request, retry=True), frames)  # the gateway's second round
    encoded, _ = await reply_to(socket, "l2", timeout_s=120)
    assert (await stats_of(socket)).cache_misses == misses + 1  # one video missed once, asked for twice
    await socket.send(*lookup_only("l3", loaded, b"\x04" * 16))
    hit, _ = await reply_to(socket, "l3", timeout_s=120)
    assert isinstance(hit, VideosEncodeResult) and hit.videos[0].cache_hit
    assert hit.videos[0] == msgspec.structs.replace(encoded.videos[0], cache_hit=True)  # key, grid, time axis
    await socket.send(*lookup_only("l4", loaded, b"\x04" * 16, VideoKnobs(max_pixels=160 * 120)))
    other_knobs, _ = await reply_to(socket, "l4", timeout_s=120)
    assert isinstance(other_knobs, EncodeNeedsPixels)  # another key: not a false hit
    frames, metadata = loaded  # as a header one frame over its stream promises: a frame no decode read
    promised = dict(metadata, total_num_frames=metadata["total_num_frames"] + 1, frames_indices=[*metadata["frames_indices"], metadata["total_num_frames"]])
    await socket.send(*lookup_only("l5", (frames, promised), b"\x04" * 16))
    other_frames, _ = await reply_to(socket, "l5", timeout_s=120)
    assert isinstance(other_frames, EncodeNeedsPixels)  # not the tokens of the frames read, with a time axis of others
    socket.close()


def test_a_video_sent_without_frames_is_answered_from_the_cache_or_asked_for(encoder):
    asyncio.run(looked_up(encoder[0]))


async def same_clip_at_once(address: str) -> None:
    first, second = await connect(address), await connect(address)
    before = await stats_of(first)
    loaded = clip(2)
    await first.send(*video_request("a", loaded, b"\x02" * 16))
    await second.send(*video_request("b", loaded, b"\x02" * 16))
    a, _ = await reply_to(first, "a", timeout_s=120)
    b, _ = await reply_to(second, "b", timeout_s=120)
    after = await stats_of(first)
    assert a.videos[0].key == b.videos[0].key
    assert after.images_encoded == before.images_encoded + 1 and after.cache_joins == before.cache_joins + 1
    first.close(), second.close()


def test_two_requests_for_one_new_clip_at_once_encode_it_once(encoder):
    asyncio.run(same_clip_at_once(encoder[0]))


async def video_beside_image(address: str, path) -> None:
    socket = await connect(address)
    before = await stats_of(socket)
    loaded = clip(3)
    picture = np.ascontiguousarray(loaded[0][0])
    meta, frame = to_frame(picture)
    await socket.send(*video_request("video", loaded, b"\x03" * 16))
    await socket.send(EncodeRequest("image", [ImageInput(b"\x04" * 16, meta)]), [frame])
    answers = await replies_to(socket, ["video", "image"], timeout_s=120)
    video, image = answers["video"], answers["image"]
    after = await stats_of(socket)
    assert isinstance(video, VideosEncodeResult) and isinstance(image, EncodeResult)
    assert after.batches == before.batches + 1 and after.images_encoded == before.images_encoded + 2
    expected = path.encode_clip(VideoClip.from_metadata(*loaded)).tokens
    torch.testing.assert_close(await fetched(socket, address, video.videos[0].key, video.videos[0].identity), expected,
                               rtol=1e-5, atol=1e-5)
    socket.close()


def test_a_video_and_an_image_ride_one_batch_each_with_its_own_tokens(encoder):
    asyncio.run(video_beside_image(*encoder))


async def refused(address: str) -> None:
    socket = await connect(address)
    frames, metadata = clip(4)
    request, frame = video_request("bad", (frames, dict(metadata, frames_indices=[0])), b"\x05" * 16)
    await socket.send(request, frame)
    answer, _ = await reply_to(socket, "bad", timeout_s=60)
    assert isinstance(answer, EncodeFailed) and answer.status == 400 and "video 0" in answer.message
    request, frame = video_request("flat", (frames[:, :0], metadata), b"\x05" * 16)  # frames of no height
    await socket.send(request, frame)
    answer, _ = await reply_to(socket, "flat", timeout_s=60)
    assert isinstance(answer, EncodeFailed) and answer.status == 400 and "video 0" in answer.message, answer
    socket.close()


def test_frames_that_no_loader_yields_are_the_request_s_400(encoder):
    asyncio.run(refused(encoder[0]))
