"""The parity reference: vLLM's own multimodal path, in-process, raw images.

vLLM loads the full checkpoint (vision tower included), runs its own HF
processor on the undecoded-by-Prism image, and decodes greedily in float32,
one request at a time. Writes {case name: {text, token_ids, prompt_tokens,
prefixes, margins}}: the text after each token, and how far the chosen token's
log-probability was above the runner-up's (cases.matches_reference).

With `--cases NAME,NAME` only those of cases.CASES are answered
(test_families asks cases.FAMILY_CASES). With `--videos` (the Qwen families' stacks, tests/integration/test_families.py)
the same engine also answers the video cases (reference_video_vllm.py
`family_video_references`), under the same pixel budget.

Run: python tests/integration/reference_vllm.py MODEL_DIR IMAGE_DIR OUT.json [--videos] [--cases NAME,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.cases import CASES  # noqa: E402
from tests.integration.reference_records import pixel_budget, record  # noqa: E402
from tests.integration.reference_video_vllm import family_video_references  # noqa: E402


def chat_template_messages(case) -> list[dict]:
    def part(p):
        return {"type": "image"} if p["type"] == "image" else p

    return [{**m, "content": m["content"] if isinstance(m["content"], str) else [part(p) for p in m["content"]]} for m in case.messages]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="vLLM's answers to the parity cases")
    parser.add_argument("model")
    parser.add_argument("image_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--videos", action="store_true", help="the video cases too (the Qwen families)")
    parser.add_argument("--cases", default="", help="NAME,NAME of cases.CASES (all when empty)")
    return parser.parse_args()


def main() -> None:
    # The engine core in this process, not a child: the answers are the same
    # (token for token), and the run takes 17 s of CPU instead of 43. vLLM's
    # child processes spin while they wait, on the two cores the stack under
    # test is starting on at the same time.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from PIL import Image
    from vllm import LLM, SamplingParams

    args = arguments()
    model, image_dir, videos = args.model, args.image_dir, args.videos
    llm = LLM(
        model,
        dtype="float32",
        max_model_len=4096,
        limit_mm_per_prompt={"image": 4, "video": 2 if videos else 0},
        mm_processor_kwargs=pixel_budget(model),
        kv_cache_memory_bytes=256 * 2**20,
        enforce_eager=True,
        seed=0,
    )
    tokenizer = llm.get_tokenizer()
    results = {}
    for name in args.cases.split(",") if args.cases else CASES:
        case = CASES[name]
        prompt = tokenizer.apply_chat_template(chat_template_messages(case), tokenize=False, add_generation_prompt=True)
        request: dict = {"prompt": prompt}
        if names := case.image_names():
            images = [Image.open(image_dir / f"{n}.png").convert("RGB") for n in names]
            request["multi_modal_data"] = {"image": images}
        params = SamplingParams(max_tokens=case.max_tokens, temperature=0.0, logprobs=2)
        results[name] = record(llm.generate([request], params, use_tqdm=False)[0], tokenizer)
    if videos:
        results.update(family_video_references(llm, model, image_dir))
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
