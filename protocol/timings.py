"""The encoder's durations as it reports them to the gateway (images' and videos' answers alike)."""

from __future__ import annotations

import msgspec


class EncoderTimings(msgspec.Struct, array_like=True, frozen=True, gc=False):
    cache_lookup_s: float
    encode_queue_s: float
    encode_s: float
    total_s: float  # arrival → reply sent; the gateway derives transfer time from it
