"""A video's encoding work, Prism's encoder beside vLLM's own, on the same frames.

Prism: `QwenVideo.preprocess` (the checkpoint's video processor) and
`encode` (the packed tower), timed apart. vLLM: the time its raw-video
request takes over the same request with Prism's tokens as embeddings
(max_tokens 1, prefix and processor caches off), i.e. its processor and
tower for that video. Both in one process, float32, the same torch threads,
interleaved, median of the repeats. The clip: loadtest/clips.py's scene,
loaded as vLLM's server loads it for the checkpoint (testing/video_clips.py).

Run: python -m bench.video_encoder [--model DIR] [--seconds 10] [--size 640x360] [--repeats 5]
Figures go to docs/measurements/video-encoder.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from llm_engine.videos import VideoEmbeds, video_data
    from loadtest.clips import clip
    from prism.demo_model import RANDOM_MODEL, ensure_demo_model
    from testing.video_clips import server_loader, vllm_loaded
    from vision_encoder.towers.qwen_video import QwenVideo, VideoClip
    from vision_encoder.towers import load_tower

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--size", default="640x360")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = args.model or str(ensure_demo_model(RANDOM_MODEL))
    width, height = (int(v) for v in args.size.split("x"))
    loaded = vllm_loaded(clip(width, height, 10.0, duration_s=args.seconds), backend=server_loader(model))
    video = QwenVideo(load_tower(model, "float32", "cpu"))
    llm = LLM(model, dtype="float32", max_model_len=16384, limit_mm_per_prompt={"image": 0, "video": 1}, enable_mm_embeds=True,
              enable_prefix_caching=False, mm_processor_cache_gb=0, kv_cache_memory_bytes=512 * 2**20, enforce_eager=True, seed=0)
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}], tokenize=False,
        add_generation_prompt=True)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def timed(request) -> float:
        start = time.perf_counter()
        llm.generate([request], params, use_tqdm=False)
        return time.perf_counter() - start

    clip_in = VideoClip.from_metadata(*loaded)
    figures: dict[str, list[float]] = {"prism_preprocess": [], "prism_tower": [], "vllm_raw": [], "vllm_embeds": []}
    for _ in range(args.repeats + 1):  # the first round warms both up and is not counted
        start = time.perf_counter()
        prepped = video.preprocess(clip_in)
        preprocessed = time.perf_counter()
        tokens = video.encode(prepped)
        encoded = time.perf_counter()
        embeds = VideoEmbeds(tokens.tokens, tokens.grid_thw, tokens.second_per_grid_t, tokens.timestamps)
        round_ = {"prism_preprocess": preprocessed - start, "prism_tower": encoded - preprocessed,
                  "vllm_raw": timed({"prompt": prompt, "multi_modal_data": {"video": [loaded]}}),
                  "vllm_embeds": timed({"prompt": prompt, "multi_modal_data": {"video": video_data([embeds], video.family)}})}
        for name, value in round_.items():
            figures[name].append(value)
    median = {name: statistics.median(values[1:]) for name, values in figures.items()}
    prism = median["prism_preprocess"] + median["prism_tower"]
    vllm_video = median["vllm_raw"] - median["vllm_embeds"]
    frames, metadata = loaded
    print(f"clip {width}x{height}, {args.seconds:g} s at 10 fps, {frames.shape[0]} frames kept ({server_loader(model)} loader), "
          f"grid {tokens.grid_thw}, {tokens.tokens.shape[0]} tokens, torch threads {__import__('torch').get_num_threads()}")
    for name, value in median.items():
        print(f"{name:18s} {value * 1000:8.1f} ms")
    print(f"prism encode (processor + tower) {prism * 1000:.1f} ms; vLLM raw over embeds {vllm_video * 1000:.1f} ms; "
          f"ratio {prism / vllm_video:.2f}")


if __name__ == "__main__":
    main()
