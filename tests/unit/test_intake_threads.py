"""Images and videos are taken in on threads of their own (gateway.intake_workers,
gateway.video_intake_workers): a video's decode holds its thread for as long
as it runs (up to `max_video_decode_s`), and an image must never queue behind
it, nor a video behind images."""

from __future__ import annotations

import asyncio
import threading

from bench.intake import qwen_policy
from gateway.api.pipeline import ChatPipeline
from gateway.config import GatewayConfig
from gateway.intake.images import inspect
from gateway.intake.video.sampling import VideoSampling
from gateway.timing import RequestTimer
from loadtest.clips import clip
from tests.unit.test_encode_rounds import png

POLICY = qwen_policy(140 * 140)
WHERE = "messages[0].content[0]"
# Far longer than either job takes: reached only where the job waits for the held threads.
BLOCKED_S = 60


def pipeline() -> ChatPipeline:
    return ChatPipeline(GatewayConfig(intake_workers=1, video_intake_workers=1), None, None, POLICY, None)


async def with_threads_held(pool, job):
    """`job()`'s result, awaited while every thread of `pool` (one) waits on an event, let go
    BLOCKED_S later or once the job is done; and whether the job was done before that."""
    release = threading.Event()
    pool.submit(release.wait)
    letting_go = threading.Timer(BLOCKED_S, release.set)
    letting_go.start()
    try:
        result = await job()
        return result, not release.is_set()
    finally:
        release.set()
        letting_go.cancel()


def test_an_image_is_decoded_while_a_video_holds_every_video_thread():
    chat = pipeline()
    item = inspect(png((200, 10, 10)), WHERE, POLICY, POLICY.default_budget)
    prepared, done_while_held = asyncio.run(with_threads_held(chat.videos.pool, lambda: chat._decode([item], RequestTimer())))
    assert done_while_held and len(prepared) == 1 and prepared[0].nbytes > 0


def test_a_video_is_read_while_images_hold_every_image_thread():
    chat = pipeline()
    raw = clip(num_frames=12, fps=10.0)
    inspected, done_while_held = asyncio.run(with_threads_held(chat.pool, lambda: chat.videos.inspect(raw, WHERE, VideoSampling())))
    assert done_while_held and inspected.source.total_frames == 12
    chat.videos.decoders.close()


def test_a_closed_pipeline_s_intake_threads_end():
    """A retired model's pipeline (gateway/api/models.py ServedModel.close): its threads, images' and
    videos', end rather than wait for work that will never come, reload after reload."""
    from tests.waiting import wait_until

    chat = pipeline()
    for pool in (chat.pool, chat.video_pool):
        pool.submit(int).result()  # a thread started
    threads = [*chat.pool._threads, *chat.video_pool._threads]
    assert threads and all(thread.is_alive() for thread in threads)
    chat.close()
    wait_until(lambda: not any(thread.is_alive() for thread in threads), 10, "the intake threads ended")
    chat.videos.decoders.close()
