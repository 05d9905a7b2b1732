"""How fast this process decodes each codec, so a video that cannot decode within
`max_video_decode_s` is refused before its decode rather than after it.

A decode reads every frame up to the last kept one (gateway/intake/video/decode.py),
so its work is those frames' pixels. Each codec keeps the fastest rate a decode of
it reached here, over at least MIN_FRAMES frames: whole decodes, and those stopped
at their deadline (how far they got), not those a client's leaving stopped. A rate
counts from the decode's first kept frame (intake.py, FirstFrame): what comes before
it (the job's bytes sent to a decoder process, the container opened) costs a short
clip as much as a long one, and counted in, a short clip's rate was a fraction of
its codec's, which then refused long clips that would have decoded in time. A rate
measured while other decodes shared the cores is lower than the codec's, and one
file of a codec may decode slower than another, so a video is refused only when its
estimate at that rate is past the limit by MARGIN: one refused would have run out
of time all the same. Until a codec has been decoded here, and for a container that
names no codec, nothing is refused early: the decode's own deadline still holds.
Each gateway process learns its own rates (its first long video of a codec runs
into the deadline).
"""

from __future__ import annotations

import threading

MIN_FRAMES = 8  # fewer make a rate of the container's opening more than of its frames
MARGIN = 2.0  # an estimate past the limit by this much is refused before its decode


class DecodeSpeeds:
    """The fastest decode of each codec seen, in frame pixels a second. Shared by the intake threads."""

    def __init__(self) -> None:
        self._fastest: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, codec: str, frames: int, width: int, height: int, seconds: float) -> None:
        """A decode that read `frames` frames of width × height in `seconds`."""
        if not codec or frames < MIN_FRAMES or seconds <= 0:
            return
        with self._lock:
            self._fastest[codec] = max(self._fastest.get(codec, 0.0), frames * width * height / seconds)

    def best_case_s(self, codec: str, frames: int, width: int, height: int) -> float | None:
        """The fewest seconds reading `frames` frames of width × height took here at the codec's
        fastest; None: this codec was never decoded here."""
        with self._lock:
            fastest = self._fastest.get(codec)
        return None if fastest is None else frames * width * height / fastest

    def too_slow(self, codec: str, frames: int, width: int, height: int, limit_s: float) -> float | None:
        """The best case, where it is past `limit_s` by MARGIN (the video is to be refused); else None."""
        best_case_s = self.best_case_s(codec, frames, width, height)
        return best_case_s if best_case_s is not None and best_case_s > MARGIN * limit_s else None
