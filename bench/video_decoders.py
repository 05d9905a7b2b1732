"""What decoding a video in a decoder process costs against decoding it in the
gateway's own process (gateway/intake/video/decoders.py), side by side in one
run: the intake's decode of the kept frames (`intake.decode`, each frame
resized in the gateway as it arrives), in this process (`InProcess`) and
through a warm decoder process, interleaved; then a cold process's first job,
decodes whose request leaves after their first frame (each followed by the
next request's), and what an idle decoder holds. Figures go to
docs/measurements/video-decoders.md.

    python -m bench.video_decoders --runs 9
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.burst import rss
from gateway.intake.video.decode import Cutoff, InProcess
from gateway.intake.video.decoders import DecoderProcesses
from gateway.intake.video.intake import decode, sampled
from gateway.intake.video.limits import VideoLimits
from gateway.intake.video.sampling import VideoSampling
from gateway.intake.video import intake as video_intake
from gateway.intake.video.sizing import FramePlan
from loadtest.clips import clip

LIMITS = VideoLimits(max_bytes=256 * 2**20, max_frame_pixels=3840 * 2160, max_total_frames=100_000,
                     max_duration_s=3600, max_sampled_frames=768)
# (name, width, height, frames at 30 fps, the size kept frames are resized to: Qwen2.5-VL's at its defaults)
CLIPS = [("240p-4s", 320, 240, 120, None), ("720p-10s", 1280, 720, 300, (448, 812)),
         ("1080p-10s", 1920, 1080, 300, (448, 812))]


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    here, processes = InProcess(), DecoderProcesses(idle_kept=1)
    print(f"{'clip':10} {'kept':>4} {'in process':>11} {'decoder':>9} {'ratio':>6} {'cold decoder':>13}")
    for name, width, height, frames, size in CLIPS:
        raw = clip(width, height, fps=30.0, num_frames=frames, seed=4)
        source = video_intake.read_figures(raw, name, LIMITS, here)
        plan = None if size is None else (lambda kept, whole, h, w, size=size: FramePlan(size, 0))
        item = sampled(raw, name, source, VideoSampling(), b"", plan)
        decode(item, processes)  # the warm process started
        local, remote = [], []
        for _ in range(args.runs):  # interleaved: the machine's other load falls on both alike
            local.append(_timed(lambda: decode(item, here)))
            remote.append(_timed(lambda: decode(item, processes)))
        cold = DecoderProcesses(idle_kept=0)
        first = _timed(lambda: decode(item, cold))
        local_ms, remote_ms = statistics.median(local), statistics.median(remote)
        print(f"{name:10} {len(item.indices):4} {local_ms:9.1f} ms {remote_ms:7.1f} ms {remote_ms / local_ms:6.2f} {first:10.1f} ms")
    left_part_way(processes, args.runs)
    pid = processes.pids(busy=False)[0]
    print(f"an idle decoder after these jobs: RSS {rss(pid, 'VmRSS') / 2**20:.0f} MB, "
          f"of it anonymous {rss(pid, 'RssAnon') / 2**20:.0f} MB; its peak {rss(pid, 'VmHWM') / 2**20:.0f} MB")
    big = clip(3840, 2160, fps=30.0, num_frames=30, seed=4)
    fresh = DecoderProcesses(idle_kept=1)
    fresh.header(big, Cutoff(), 0)
    pid = fresh.pids(busy=False)[0]
    before = rss(pid, "VmHWM")
    item = sampled(big, "4k", video_intake.read_figures(big, "4k", LIMITS, here), VideoSampling(), b"", None)
    decode(item, fresh)
    print(f"a 4K clip's decode (30 frames, {len(item.indices)} kept) grew its decoder's peak by "
          f"{(rss(pid, 'VmHWM') - before) / 2**20:.0f} MB; admitted for its decoder: "
          f"{12 * 3840 * 2160 * 3 / 2**20:.0f} MB")
    processes.close()
    fresh.close()


def left_part_way(processes: DecoderProcesses, runs: int) -> None:
    """Decodes whose request left after their first frame (a 720p clip's, 20 frames kept), each
    followed at once by the next request's decode (a 240p clip's): how long the leaving request's
    thread was held, the next decode's time, and the decoders started for them."""
    long = clip(1280, 720, fps=30.0, num_frames=300, seed=5)
    indices = list(range(0, 300, 15))
    small = clip(320, 240, fps=30.0, num_frames=120, seed=6)
    item = sampled(small, "next", video_intake.read_figures(small, "next", LIMITS, InProcess()), VideoSampling(), b"", None)
    decode(item, processes)
    started, held, following = processes.started, [], []
    for _ in range(runs):
        jobs = processes.frames(long, indices, 720, 1280, Cutoff(), 12 * 1280 * 720 * 3)
        next(jobs)
        held.append(_timed(jobs.close))
        following.append(_timed(lambda: decode(item, processes)))
    print(f"a request that left after its first frame: its thread held {statistics.median(held):.1f} ms; the next "
          f"decode {statistics.median(following):.1f} ms; decoders started: {processes.started - started} for {runs}")


if __name__ == "__main__":
    main()
