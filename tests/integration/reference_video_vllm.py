"""The video parity reference: vLLM's own raw-video path, greedy in float32.

Each clip goes through the loader vLLM's server picks for the checkpoint
(testing/video_clips.server_loader: qwen2_vl at 2 fps for Qwen2-VL and
Qwen2.5-VL, qwen3_vl for Qwen3-VL), then the full checkpoint's processor
and tower, under the test stack's pixel budget as `mm_processor_kwargs`
(reference_records.pixel_budget): vLLM hands it to the video processor too.

- `main`: the demo model, in a child process beside the stack
  (tests/integration/test_video_serving.py). Writes {clip name: {text,
  token_ids, prompt_tokens}}.
- `family_video_references`: the Qwen2.5-VL and Qwen3-VL stacks' cases
  (tests/integration/test_families.py), answered in the image reference's
  own engine (reference_vllm.py --videos), so a family starts vLLM once.

Run: python tests/integration/reference_video_vllm.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtest.clips import ClipSpec, make_clip  # noqa: E402
from testing.video_clips import CLIPS, CONCURRENT_CLIPS, ONE_FRAME_FILE, OVER_BUDGET, server_loader, vllm_loaded  # noqa: E402
from tests.integration.reference_records import pixel_budget, record  # noqa: E402

CLIP_NAMES = ("short", "portrait", "slow", "over-budget")
QUESTION = "What moves in this clip?"
MAX_TOKENS = 8

# Every clip the stack tests send, by name: those a server loader takes (the one-frame case
# is a file of one frame instead, which vLLM's loaders refuse), one over the budget, the concurrent ones
SERVED_CLIPS: dict[str, ClipSpec] = {**{n: c.spec for n, c in CLIPS.items() if n != "one-frame"},
                                     "over-budget": OVER_BUDGET.spec, **{n: c.spec for n, c in CONCURRENT_CLIPS.items()}}
FAMILY_CLIPS = [n for n in SERVED_CLIPS if n not in CONCURRENT_CLIPS]  # the families' one-per-request cases
MIXED_VIDEOS = ("odd", "six-seconds")
MIXED_IMAGE = "landscape"  # over the budget as well (tests/integration/cases.py)


def video_prompt(tokenizer, parts: list[dict]) -> str:
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def family_video_references(llm, model: str, image_dir: Path) -> dict:
    """{"video-<clip>", "video-<clip>-unbudgeted", "two-videos-and-an-image": record,
    "video-one-frame-file": {"refused": why}} from `llm` (started with the budget)."""
    from PIL import Image
    from transformers import AutoVideoProcessor
    from vllm import SamplingParams

    tokenizer, loader = llm.get_tokenizer(), server_loader(model)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    one = video_prompt(tokenizer, [{"type": "video"}])

    def request(name: str, **extra) -> dict:
        return {"prompt": one, "multi_modal_data": {"video": [vllm_loaded(make_clip(SERVED_CLIPS[name]), backend=loader)]}, **extra}

    def answer(requests: list[dict]) -> list[dict]:
        return [record(output, tokenizer) for output in llm.generate(requests, params, use_tqdm=False)]

    results = {f"video-{name}": answer([request(name)])[0] for name in FAMILY_CLIPS}
    # the budget bites: the same clip at the video processor's own size has more tokens
    size = AutoVideoProcessor.from_pretrained(model).size
    default = {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}
    results["video-over-budget-unbudgeted"] = answer([request("over-budget", mm_processor_kwargs=default)])[0]
    # scheduled together, as concurrent requests are
    results.update(zip((f"video-{n}" for n in CONCURRENT_CLIPS), answer([request(n) for n in CONCURRENT_CLIPS])))
    mixed = video_prompt(tokenizer, [{"type": "video"}, {"type": "image"}, {"type": "video"}])
    videos = [request(n)["multi_modal_data"]["video"][0] for n in MIXED_VIDEOS]
    image = Image.open(image_dir / f"{MIXED_IMAGE}.png").convert("RGB")
    results["two-videos-and-an-image"] = answer([{"prompt": mixed, "multi_modal_data": {"video": videos, "image": [image]}}])[0]
    results["video-one-frame-file"] = one_frame_refusal(llm, one, loader, params)
    return results


def one_frame_refusal(llm, prompt: str, loader: str, params) -> dict:
    """vLLM's server path on a one-frame file: {"refused": why}, None if it answered."""
    try:
        clip = vllm_loaded(make_clip(ONE_FRAME_FILE), backend=loader)
        llm.generate([{"prompt": prompt, "multi_modal_data": {"video": [clip]}}], params, use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raises is its refusal
        return {"refused": f"{type(exc).__name__}: {exc}"[:300]}
    return {"refused": None}


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as reference_vllm.py: the engine core in this process
    from vllm import LLM, SamplingParams

    model, out = sys.argv[1], Path(sys.argv[2])
    llm = LLM(model, dtype="float32", max_model_len=4096, limit_mm_per_prompt={"image": 0, "video": 1},
              mm_processor_kwargs=pixel_budget(model), kv_cache_memory_bytes=256 * 2**20, enforce_eager=True, seed=0)
    prompt = video_prompt(llm.get_tokenizer(), [{"type": "video"}])
    results = {}
    for name in CLIP_NAMES:
        clip = vllm_loaded(make_clip(SERVED_CLIPS[name]), backend=server_loader(model))
        request = {"prompt": prompt, "multi_modal_data": {"video": [clip]}}
        output = llm.generate([request], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)[0]
        results[name] = {"text": output.outputs[0].text, "token_ids": list(output.outputs[0].token_ids),
                         "prompt_tokens": len(output.prompt_token_ids)}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
