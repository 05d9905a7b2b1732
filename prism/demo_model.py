"""Write the embedded demo checkpoint: a tiny Qwen2-VL with random weights.

The checkpoint has the real Qwen2-VL architecture, a byte-level BPE tokenizer
with the Qwen special tokens and chat template, and the image/video processor
configs, so every service loads it exactly like a hub checkpoint — with no hub
access. Sizes follow what vLLM's CPU backend accepts (see docs/demo-model.md):
text head size 64, mrope_section summing to head_dim / 2.

Run: python -m prism.demo_model --out models/prism-demo-qwen2vl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from common.config import REPO_ROOT

# Two checkpoints ship with Prism. The trained one (prism/train_demo.py, committed)
# is the default and answers questions about shape scenes. The random-weights one
# is generated on demand; tests and benchmarks that need generations running to
# max_tokens, and realistic 1-megapixel token counts, use it.
RANDOM_MODEL = REPO_ROOT / "models" / "prism-demo-qwen2vl"
SHAPES_MODEL = REPO_ROOT / "models" / "prism-shapes"

SEED = 1234
VOCAB_SIZE = 2048
DEFAULT_MAX_PIXELS = 1024 * 1024
DEFAULT_MIN_PIXELS = 56 * 56

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's chat template, trimmed to what the demo needs (system default,
# string or list content, one <|vision_start|><|image_pad|><|vision_end|> per
# image and one <|vision_start|><|video_pad|><|vision_end|> per video), with
# Qwen2.5's tool calling: the tools listed in the system prompt,
# calls as <tool_call>{"name": ..., "arguments": ...}</tool_call> (vLLM's
# hermes parser reads them back), results as <tool_response> in a user turn.
# Qwen3's `enable_thinking: false` (a chat_template_kwargs switch) opens the
# answer with an empty <think></think>. Without either it renders exactly as
# Qwen2-VL's does. (HF renders with trim_blocks: a newline right after a tag
# is written as {{ '\\n' }}.)
CHAT_TEMPLATE = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% elif content %}{% for part in content %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ render(messages[0]['content']) }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ render(message['content']) }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif not (loop.first and tools and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ render(message['content']) }}"
    "{% if message.tool_calls is defined and message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set function = call.function if call.function is defined else call %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ function.name }}\", \"arguments\": {{ function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# A thinking model's (Qwen3's thinking-only checkpoints, DeepSeek-R1): the answer opens
# inside <think>, which the model closes; `enable_thinking: false` still closes it at once.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("</think>\n\n{% endif %}{% endif %}", "</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")

_WORDS = (
    "the a an image picture photo shows there is are of in on with and red green "
    "blue yellow orange purple black white gray circle square triangle shape shapes "
    "one two three how many what colour color describe left right top bottom small "
    "large background foreground assistant user system question answer yes no this "
    "that it cat dog car tree house sky road person people water light dark"
).split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) for _ in range(lines)]


def build_tokenizer(seed: int, extra_lines: list[str] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed) + list(extra_lines), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192,
    )


def build_config(tokenizer, text_layers: int = 2, text_intermediate: int = 256, vision: dict | None = None, kv_heads: int = 1):
    from transformers import Qwen2VLConfig

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=text_intermediate,
        num_hidden_layers=text_layers,
        num_attention_heads=2,  # head size 64: accepted by vLLM's CPU attention
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,  # room for the hang-up tests' 30,000-token generations
        rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12], "rope_theta": 1000000.0},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=2,
        embed_dim=64,
        num_heads=2,
        mlp_ratio=2,
        hidden_size=128,  # merger output = text hidden size
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    ) | (vision or {})
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def processor_configs(
    max_pixels: int, min_pixels: int, *, patch_size: int = 14, mean: list = CLIP_MEAN, std: list = CLIP_STD,
    image_processor: str = "Qwen2VLImageProcessor", processor: str = "Qwen2VLProcessor", video_processor: str = "Qwen2VLVideoProcessor",
) -> tuple[dict, dict]:
    """A Qwen-style image and video processor config (Qwen2-VL's by default)."""
    image = {
        "image_processor_type": image_processor,
        "processor_class": processor,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": mean,
        "image_std": std,
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }
    video = {**image, "video_processor_type": video_processor}
    del video["image_processor_type"]
    return image, video


def write_demo_model(out: Path, seed: int = SEED, max_pixels: int = DEFAULT_MAX_PIXELS) -> Path:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer = build_tokenizer(seed)
    config = build_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    return save_checkpoint(out, model, tokenizer, max_pixels, DEFAULT_MIN_PIXELS, {"seed": seed, "kind": "random-weights"})


def save_checkpoint(out: Path, model, tokenizer, max_pixels: int, min_pixels: int, about: dict) -> Path:
    """Weights, tokenizer, processor configs and chat template: all a loader looks for."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    write_processor_configs(out, max_pixels, min_pixels)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "prism_demo.json").write_text(json.dumps(about, indent=2) + "\n")
    return out


def write_processor_configs(out: Path, max_pixels: int, min_pixels: int) -> None:
    image_cfg, video_cfg = processor_configs(max_pixels, min_pixels)
    (out / "preprocessor_config.json").write_text(json.dumps(image_cfg, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_cfg, indent=2))


def ensure_demo_model(out: Path, seed: int = SEED) -> Path:
    """Write the checkpoint unless a complete one is already there (then only
    its chat template is brought up to date: it is not part of the weights)."""
    if (out / "prism_demo.json").exists():
        refresh_chat_template(out)
        return out
    return write_demo_model(out, seed)


def refresh_chat_template(out: Path, template: str = CHAT_TEMPLATE) -> None:
    path = out / "chat_template.jinja"
    if not path.exists() or path.read_text() != template:
        path.write_text(template)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RANDOM_MODEL)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    print(write_demo_model(args.out, args.seed))


if __name__ == "__main__":
    main()
