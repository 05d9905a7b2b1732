"""bench.video_compare's own arithmetic: the smaller gateway limit of (d)
leaves room for a few of its clips' decodes (not none, not all eight), and
the report's command line leaves the entry's note out."""

from __future__ import annotations

from pydantic import ByteSize, TypeAdapter

from bench.video_compare import MEMORY_USE_FRACTION, Sizes, _options, long_clip_decode, small_memory_limit


def test_the_smaller_limit_holds_a_few_long_clips_decodes_beside_the_gateway():
    sizes = Sizes()
    one = long_clip_decode(sizes)
    for gateway_rss in (500 * 2**20, 800 * 2**20):
        limit = TypeAdapter(ByteSize).validate_python(small_memory_limit(gateway_rss, sizes))  # as the gateway reads it
        room = int(limit * MEMORY_USE_FRACTION) - gateway_rss
        assert 3 * one <= room < 4 * one < sizes.long_clips * one


def test_the_reported_command_leaves_the_note_out():
    assert _options(["--scale", "0.5", "--note", "a busy machine", "--no-record"]) == ["--scale", "0.5", "--no-record"]
    assert _options(["--note=quiet", "--small-memory-limit", "2GiB"]) == ["--small-memory-limit", "2GiB"]
