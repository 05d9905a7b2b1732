"""What both vLLM reference runs share (reference_vllm.py for images,
reference_video_vllm.py for videos): the test pixel budget as vLLM's
`mm_processor_kwargs`, and one greedy answer recorded as the tests compare it.
"""

from __future__ import annotations

from tests.integration.cases import TEST_MAX_PIXELS, TEST_MIN_PIXELS


def pixel_budget(model: str) -> dict | None:
    """The test budget for Qwen's families; LLaVA-OneVision tiles at its grid pinpoints and has none."""
    from transformers import AutoConfig

    from common.families import family_of

    if family_of(AutoConfig.from_pretrained(model)).layout != "qwen":
        return None
    return {"max_pixels": TEST_MAX_PIXELS, "min_pixels": TEST_MIN_PIXELS}


def top_two_gap(position: dict) -> float:
    """The chosen token's log-probability less the runner-up's (logprobs=2)."""
    best, second = sorted((entry.logprob for entry in position.values()), reverse=True)[:2]
    return best - second


def record(output, tokenizer) -> dict:
    """One greedy answer as the tests compare it (cases.matches_reference)."""
    completion = output.outputs[0]
    token_ids = list(completion.token_ids)
    return {
        "text": completion.text,
        "token_ids": token_ids,
        "prompt_tokens": len(output.prompt_token_ids),
        "finish_reason": completion.finish_reason,
        "prefixes": [tokenizer.decode(token_ids[: k + 1], skip_special_tokens=True) for k in range(len(token_ids))],
        "margins": [top_two_gap(position) for position in completion.logprobs],
    }
