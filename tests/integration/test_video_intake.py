"""Videos through the running stack, with the official openai client: every
hostile video is refused with its own 4xx naming the part and the limit
before any model time (nothing reaches the encoder or the engine), a valid
one is answered, and the service answers the next request."""

from __future__ import annotations

import base64
import os
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from testing.stack import free_port
from loadtest.clips import clip
from testing.video_clips import lying_avi
from tests.integration.conftest import (ALLOWED_LOOPBACK, MAX_VIDEO_BYTES, MAX_VIDEO_FRAME_PIXELS,
                                        MAX_VIDEO_SAMPLED_FRAMES, MODEL_NAME)
from tests.integration.corpus import b64, save, scene
from tests.integration.helpers import metric_total

CLIP = clip(width=160, height=120, fps=10.0, num_frames=12, seed=46)


def data_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def patched(data: bytes, box: bytes, offset: int, value: bytes) -> bytes:
    at = data.index(box) + offset
    return data[:at] + value + data[at + len(value):]


# name → (video bytes, status, what the message says)
HOSTILE = {
    "empty": (b"", 400, "is empty"),
    "random-bytes": (os.urandom(4000), 415, "not a video container (unrecognised bytes)"),
    "png": (save(scene((64, 48), "png"), "PNG"), 415, "a PNG image"),
    "truncated": (CLIP[: len(CLIP) // 2], 400, "cannot be read"),
    "garbage-after-signature": (CLIP[:32] + os.urandom(3000), 400, "cannot be read"),
    "audio-only": (patched(CLIP, b"hdlr", 12, b"soun"), 400, "no decodable video stream"),
    "claims-50M-frames": (patched(CLIP, b"stts", 12, struct.pack(">I", 50_000_000)), 413,
                          "claims 50000000 frames; the limit is 108000"),
    "frames-over-pixel-limit": (clip(width=1600, height=900, num_frames=2), 413,
                                f"1600×900 = 1440000 pixels; the limit is {MAX_VIDEO_FRAME_PIXELS}"),
    "too-many-frames": (clip(width=96, height=64, fps=10.0, num_frames=100), 413,
                        f"keeps 20 frames (the model's defaults); the limit is {MAX_VIDEO_SAMPLED_FRAMES}"),
    "over-byte-limit": (CLIP[:32] + os.urandom(MAX_VIDEO_BYTES + 1000), 413, f"the limit is {MAX_VIDEO_BYTES} bytes"),
    "one-frame": (clip(width=96, height=64, num_frames=1), 400, "has 1 frame; this model needs at least 2"),
}


def video_then_text(url: str) -> list[dict]:
    return [{"type": "text", "text": "Watch:"}, {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": "What moves?"}]


def ask(client, content, **extra):
    return client.chat.completions.create(model=MODEL_NAME, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": content}], extra_body=extra or None)


def refusal(client, content, **extra) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        ask(client, content, **extra)
    return caught.value


def assert_still_serving(client) -> None:
    reply = ask(client, [{"type": "image_url", "image_url": {"url": b64(save(scene((64, 48), "after"), "PNG"))}},
                         {"type": "text", "text": "What is it?"}])
    assert reply.usage.completion_tokens == 4


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_video_gets_its_4xx_naming_the_part_and_the_limit(stack, client, name):
    raw, status, needle = HOSTILE[name]
    served = [metric_total(stack, f"prism_{service}_replica_requests_total") for service in ("encoder", "engine")]
    error = refusal(client, video_then_text(data_url(raw)))
    assert [metric_total(stack, f"prism_{service}_replica_requests_total") for service in ("encoder", "engine")] == served
    assert error.status_code == status, error.message
    body = error.body
    assert body["param"] == "messages[0].content[1]" and body["message"].startswith("messages[0].content[1]: ")
    assert needle in body["message"], body["message"]
    assert_still_serving(client)


def test_a_frame_larger_than_its_header_says_is_refused_by_a_decoder_process_of_the_gateway_s(stack, client):
    """A 0.9 MB AVI whose header says 64×48 and whose fourth frame (kept) is 7500×7500: the
    gateway's decoder may take what frames of the header's size take, its allocation fails
    there, and the clip is a 400 as corrupt; the gateway goes on."""
    import psutil

    error = refusal(client, video_then_text("data:video/avi;base64," + base64.b64encode(lying_avi(7500, at=3)).decode()))
    assert error.status_code == 400 and "truncated or corrupt" in error.body["message"], error.body
    assert error.body["param"] == "messages[0].content[1]"
    decoders = [child for child in psutil.Process(stack.gateway_pid).children()
                if "gateway.intake.video.decoder_process" in " ".join(child.cmdline())]
    assert decoders, "no decoder process beside the gateway"
    assert_still_serving(client)


def test_a_valid_video_passes_the_checks_and_is_answered(client):
    assert ask(client, video_then_text(data_url(CLIP))).usage.completion_tokens == 4


def test_every_video_of_every_turn_is_checked(client):
    image = {"type": "image_url", "image_url": {"url": b64(save(scene((64, 48), "mixed"), "PNG"))}}
    bad = {"type": "video_url", "video_url": {"url": data_url(HOSTILE["png"][0])}}
    good = {"type": "video_url", "video_url": {"url": data_url(CLIP)}}
    messages = [{"role": "user", "content": [good, image]}, {"role": "assistant", "content": "A shape."},
                {"role": "user", "content": [image, good, bad]}]
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=messages)
    assert caught.value.status_code == 415 and caught.value.body["param"] == "messages[2].content[2]"


@pytest.mark.parametrize("knobs, field, status", [
    ({"fps": 0}, "media_io_kwargs.video.fps", 400),
    ({"min_frames": 8, "max_frames": 2}, "media_io_kwargs.video", 400),
    ({"num_frames": 8}, "media_io_kwargs.video.num_frames", 400),  # Qwen's loaders sample by fps
    ({"frame_recovery": True}, "media_io_kwargs.video.frame_recovery", 400),
])
def test_bad_sampling_knobs_name_the_field(client, knobs, field, status):
    error = refusal(client, video_then_text(data_url(CLIP)), media_io_kwargs={"video": knobs})
    assert error.status_code == status and error.body["param"] == field


def test_sampling_knobs_change_what_is_checked(client):
    """At fps 1 the long clip keeps 10 frames, within the limit that 2 fps (20 frames) exceeds."""
    raw = HOSTILE["too-many-frames"][0]
    assert ask(client, video_then_text(data_url(raw)), media_io_kwargs={"video": {"fps": 1}}).usage.completion_tokens == 4


def test_too_many_videos(client):
    part = {"type": "video_url", "video_url": {"url": data_url(CLIP)}}
    error = refusal(client, [part] * 5)
    assert error.status_code == 400 and "gateway.max_videos_per_request" in error.body["message"]


class _VideoServer(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/missing.mp4":
            self.send_error(404)
            return
        body = CLIP if self.path == "/clip.mp4" else HOSTILE["png"][0]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def video_server():
    server = ThreadingHTTPServer((ALLOWED_LOOPBACK, free_port()), _VideoServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{ALLOWED_LOOPBACK}:{server.server_address[1]}"
    server.shutdown()


def test_http_videos_go_through_the_images_fetch_guard_and_their_errors_name_a_video(client, video_server):
    assert ask(client, video_then_text(f"{video_server}/clip.mp4")).usage.completion_tokens == 4
    assert refusal(client, video_then_text(f"{video_server}/still.png")).status_code == 415
    refused = refusal(client, video_then_text("http://127.0.0.1:9/clip.mp4"))
    assert refused.status_code == 400 and "refused" in refused.body["message"]
    assert refused.body["code"] == "video_url_refused"  # a video's errors name a video, not an image
    missing = refusal(client, video_then_text(f"{video_server}/missing.mp4"))
    assert missing.body["code"] == "video_fetch_failed" and "fetching the video returned HTTP 404" in missing.body["message"]
    malformed = refusal(client, video_then_text("data:video/mp4;base64,@@@@"))
    assert (malformed.status_code, malformed.body["code"]) == (400, "invalid_video_url")
