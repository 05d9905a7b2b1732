"""How fast this process decodes each codec, so a video that cannot decode within
`max_video_decode_s` is refused before its decode rather than after it.

A decode reads every frame up to the last kept one (gateway/intake/video/decode.py),
so its work is those frames' pixels. Each codec keeps the fastest rate any decode of
it reached here: an estimate at that rate is the decode's best case, and a video
refused on it would have run out of time anyway. Until a codec has been decoded
once, nothing is refused early (the decode's own deadline still holds).
"""

from __future__ import annotations

import threading


class DecodeSpeeds:
    """The fastest decode of each codec seen, in frame pixels a second. Shared by the intake threads."""

    def __init__(self) -> None:
        self._fastest: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, codec: str, pixels: int, seconds: float) -> None:
        """A decode that read `pixels` (frames × width × height) in `seconds`."""
        if not codec or pixels <= 0 or seconds <= 0:
            return
        with self._lock:
            self._fastest[codec] = max(self._fastest.get(codec, 0.0), pixels / seconds)

    def best_case_s(self, codec: str, pixels: int) -> float | None:
        """The fewest seconds a decode of `pixels` can take here; None: this codec was never decoded."""
        with self._lock:
            fastest = self._fastest.get(codec)
        return None if fastest is None else pixels / fastest


def pixels_read(last_index: int, width: int, height: int) -> int:
    """What a decode up to frame `last_index` reads: every frame to it, whole."""
    return (last_index + 1) * width * height
