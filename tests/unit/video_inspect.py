"""The intake's inspect (`VideoIntake.inspect`, async, on the intake's threads) run to its
end from a test."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from gateway.intake.video.intake import InspectedVideo, Planner, VideoIntake
from gateway.intake.video.limits import VideoLimits
from gateway.intake.video.sampling import VideoSampling


def inspect(raw: bytes, where: str, sampling: VideoSampling, limits: VideoLimits, planner: Planner | None = None,
            intake: VideoIntake | None = None) -> InspectedVideo:
    """`raw` inspected by `intake` (its known headers and limits), or by a new one with `limits`."""
    if intake is not None:
        return asyncio.run(intake.inspect(raw, where, sampling, planner))
    with ThreadPoolExecutor(1) as pool:
        return asyncio.run(VideoIntake(fetcher=None, limits=limits, pool=pool).inspect(raw, where, sampling, planner))
