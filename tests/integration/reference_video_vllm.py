"""The video parity reference: vLLM's own raw-video path on the demo model, in
a child process beside the stack (tests/integration/test_video_serving.py).

Each clip of `CLIP_NAMES` goes through the loader vLLM's server picks for the
checkpoint (testing/video_clips.server_loader: qwen2_vl at 2 fps for
Qwen2-VL), then the full checkpoint's processor and tower, greedy in float32.
Writes {clip name: {text, token_ids, prompt_tokens}}.

Run: python tests/integration/reference_video_vllm.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testing.video_clips import load_parity_clips, server_loader  # noqa: E402

CLIP_NAMES = ("short", "portrait", "slow")
QUESTION = "What moves in this clip?"
MAX_TOKENS = 8


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as reference_vllm.py: the engine core in this process
    from vllm import LLM, SamplingParams

    model, out = sys.argv[1], Path(sys.argv[2])
    llm = LLM(model, dtype="float32", max_model_len=4096, limit_mm_per_prompt={"image": 0, "video": 1},
              kv_cache_memory_bytes=256 * 2**20, enforce_eager=True, seed=0)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    prompt = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    clips = load_parity_clips(server_loader(model))
    results = {}
    for name in CLIP_NAMES:
        request = {"prompt": prompt, "multi_modal_data": {"video": [clips[name]]}}
        output = llm.generate([request], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)[0]
        results[name] = {"text": output.outputs[0].text, "token_ids": list(output.outputs[0].token_ids),
                         "prompt_tokens": len(output.prompt_token_ids)}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
