"""Decoding and sampling a 10 s clip at 2 fps: OpenCV (vLLM's default loader,
and the gateway's: gateway/intake/video/decode.py) against PyAV read sequentially
and PyAV seeking to the keyframe before each kept frame. Figures go to
docs/measurements/video-decode.md.

PyAV is not a project dependency: install it beside the venv for this run
(`pip install --target DIR av`) and pass `--av-path DIR`. Each method runs in
its own process, so its peak RSS is its own; the frames of every method are
compared with OpenCV's, byte for byte.

    python -m bench.video_decode --av-path /tmp/avpkg --runs 5
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from gateway.intake.video.sampling import SourceInfo, VideoSampling, frame_indices

METHODS = ("cv2", "av-sequential", "av-seek")
SIZES = {"720p": (1280, 720), "1080p": (1920, 1080)}


def _rss_mb() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 // 2**20


def _indices(total: int, fps: float) -> list[int]:
    return frame_indices(SourceInfo(total, fps, total / fps, 0, 0), VideoSampling("qwen2_vl"))


def _cv2(data: bytes) -> np.ndarray:
    from gateway.intake.video.decode import kept_frames, open_video, probe, visible_frames

    with open_video(data) as video:
        source = probe(video)
        total = visible_frames(video, source.total_frames)
    with open_video(data) as video:
        return np.stack([rgb.copy() for _, rgb in kept_frames(video, _indices(total, source.fps), source.height, source.width)])


def _av_sequential(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        wanted = set(_indices(stream.frames, float(stream.average_rate)))
        kept = []
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                kept.append(frame.to_ndarray(format="rgb24"))
            if index >= max(wanted):
                break
    return np.stack(kept)


def _av_seek(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        fps = float(stream.average_rate)
        kept = []
        for index in _indices(stream.frames, fps):
            pts = int(round(index / fps / stream.time_base))
            container.seek(pts, stream=stream, backward=True, any_frame=False)
            kept.append(next(f for f in container.decode(stream) if f.pts >= pts).to_ndarray(format="rgb24"))
    return np.stack(kept)


def run_one(method: str, clip: Path, out: Path) -> dict:
    """In this process: one decode, timed, its frames saved for comparison."""
    data = clip.read_bytes()
    decode = {"cv2": _cv2, "av-sequential": _av_sequential, "av-seek": _av_seek}[method]
    import av  # noqa: F401  (every library imported before the clock and the memory baseline)

    import gateway.intake.video.decode  # noqa: F401
    base = _rss_mb()
    peak, done = [base], threading.Event()

    def sample_rss() -> None:  # ru_maxrss would report the imports' transient peak instead
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss_mb())

    sampler = threading.Thread(target=sample_rss)
    sampler.start()
    started = time.perf_counter()
    frames = decode(data)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    np.save(out, frames)
    peak = peak[0]
    return {"method": method, "clip": clip.stem, "ms": round(seconds * 1000, 1), "frames": int(frames.shape[0]),
            "peak_over_start_mb": peak - base}


def make_clips(folder: Path) -> list[Path]:
    """mpeg4 (OpenCV's writer, GOP 12) and H.264 (libx264 through PyAV, GOP 250), 30 fps, 10 s."""
    import av
    import cv2

    from loadtest.clips import ClipSpec, _scene, make_clip, render_frame

    clips = []
    for name, (w, h) in SIZES.items():
        spec = ClipSpec(w, h, 30.0, 300, seed=9)
        (path := folder / f"{name}-mpeg4.mp4").write_bytes(make_clip(spec))
        clips.append(path)
        scene = _scene(spec)
        with av.open(str(path := folder / f"{name}-h264.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=30)
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            stream.options = {"g": "250", "preset": "veryfast"}
            for i in range(spec.num_frames):
                rgb = cv2.cvtColor(render_frame(spec, scene, i), cv2.COLOR_BGR2RGB)
                for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        clips.append(path)
    return clips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--av-path", required=True, help="a folder PyAV was installed into (pip install --target)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "CLIP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, args.av_path)
    if args.one:
        print(json.dumps(run_one(args.one[0], Path(args.one[1]), Path(args.one[2]))))
        return
    folder = Path(tempfile.mkdtemp(prefix="video-decode-"))
    rows = defaultdict(list)
    for _ in range(args.runs):  # interleaved, so the machine's other load falls on every method alike
        for clip in make_clips(folder) if not rows else sorted(folder.glob("*.mp4")):
            for method in METHODS:
                out = folder / f"{clip.stem}-{method}.npy"
                line = subprocess.run([sys.executable, "-m", "bench.video_decode", "--av-path", args.av_path, "--one",
                                       method, str(clip), str(out)], check=True, capture_output=True, text=True).stdout
                rows[(clip.stem, method)].append(json.loads(line.strip().splitlines()[-1]))
    for (clip, method), runs in sorted(rows.items()):
        same = np.array_equal(np.load(folder / f"{clip}-{method}.npy"), np.load(folder / f"{clip}-cv2.npy"))
        print(f"{clip:12} {method:14} median {statistics.median(r['ms'] for r in runs):7.0f} ms  "
              f"min {min(r['ms'] for r in runs):6.0f}  peak over start {statistics.median(r['peak_over_start_mb'] for r in runs):4.0f} MB  "
              f"frames {runs[0]['frames']}  equal to cv2's: {same}")


if __name__ == "__main__":
    main()
