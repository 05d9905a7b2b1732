"""bench.video_compare's own arithmetic: the smaller gateway limit of (d)
leaves room for a few of its clips' decodes (not none, not all eight), and
the report's command line leaves the entry's note out."""

from __future__ import annotations

from pydantic import ByteSize, TypeAdapter

from bench.video_compare import MEMORY_USE_FRACTION, Sizes, _options, long_clip_decode, small_memory_limit
from gateway.config import GatewayConfig
from gateway.intake.memory import DECODER_PROCESS_BYTES, MemoryPlan
from gateway.intake.video.limits import VideoLimits


def test_the_smaller_limit_holds_a_few_long_clips_decodes_and_a_header_read_beside_the_gateway():
    """The budget the gateway plans from that limit (gateway/intake/memory.py MemoryPlan: less its own
    memory and its idle decoders') holds three of (d)'s decodes, not eight, and a header read, which
    admits four frames at the default size limit."""
    sizes = Sizes()
    one = long_clip_decode(sizes)
    header_read = DECODER_PROCESS_BYTES + VideoLimits(1, GatewayConfig().max_video_frame_pixels, 1, 1, 1).opening_bytes
    for gateway_rss in (500 * 2**20, 800 * 2**20):
        limit = TypeAdapter(ByteSize).validate_python(small_memory_limit(gateway_rss, sizes))  # as the gateway reads it
        config = GatewayConfig(memory_limit_bytes=limit, memory_use_fraction=MEMORY_USE_FRACTION)
        room = MemoryPlan.size(config, workers=1, rss=gateway_rss).budget
        assert 3 * one <= room < 4 * one < sizes.long_clips * one and room > header_read


def test_the_reported_command_leaves_the_note_out():
    assert _options(["--scale", "0.5", "--note", "a busy machine", "--no-record"]) == ["--scale", "0.5", "--no-record"]
    assert _options(["--note=quiet", "--small-memory-limit", "2GiB"]) == ["--small-memory-limit", "2GiB"]
