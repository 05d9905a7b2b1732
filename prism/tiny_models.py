"""Tiny random-weights checkpoints of the other families Prism serves, built
from each family's own transformers config with the real structure kept
(Qwen2.5-VL: windowed attention blocks with full-attention ones between;
Qwen3-VL: its DeepStack layers; LLaVA-OneVision: SigLIP, anyres grid
pinpoints up to 6 × 6 tiles and the anyres_max_9 shrink; LLaVA-NeXT: CLIP
with its class token dropped, the second-to-last layer's features, five
pinpoints of 1 × 2 to 3 × 1 tiles; InternVL3: InternViT, up to 12 tiles
and a thumbnail, pixel shuffle), and a text-only Qwen2 served with no encoder
(also as a thinking model, with Qwen3's <think> markers), for tests and
benchmarks on two cores. `qwen2.5-vl-7b-widths` is the
benchmark profile at real widths: Qwen2.5-VL-7B's tensor sizes with one text
layer and two vision blocks (615 MB).

Widths follow what vLLM's CPU backend accepts (text head size 64, an
mrope_section summing to head_dim / 2); the tokenizer and chat template are
the demo model's (prism/demo_model.py).

Run: python -m prism.tiny_models qwen3-vl --out models/tiny-qwen3-vl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.config import REPO_ROOT
from prism.demo_model import (
    CHAT_TEMPLATE, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, SEED, SPECIAL_TOKENS, THINKING_CHAT_TEMPLATE, build_tokenizer,
    processor_configs, refresh_chat_template,
)

QWEN2_5_VL_MODEL = REPO_ROOT / "models" / "tiny-qwen2.5-vl"
QWEN2_5_VL_7B_WIDTHS_MODEL = REPO_ROOT / "models" / "qwen2.5-vl-7b-widths"
QWEN3_VL_MODEL = REPO_ROOT / "models" / "tiny-qwen3-vl"
QWEN3_VL_MIN_PIXELS = 32 * 32
ONEVISION_MODEL = REPO_ROOT / "models" / "tiny-llava-onevision"
# The real checkpoints tile at 384 with patch 14 (27 × 27 features a tile); a
# 56-pixel tile keeps the layout (4 × 4 features a tile) at a size two cores run.
ONEVISION_TILE, ONEVISION_PATCH = 56, 14
NEXT_MODEL = REPO_ROOT / "models" / "tiny-llava-next"
INTERNVL_MODEL = REPO_ROOT / "models" / "tiny-internvl3"
TEXT_MODEL = REPO_ROOT / "models" / "tiny-qwen2-text"  # no vision part: served text-only
THINKING_MODEL = REPO_ROOT / "models" / "tiny-qwen2-thinking"  # text-only, answers open inside <think>
THINKING_TOKENS = ["<think>", "</think>"]
INTERNVL_TILE = 112  # InternVL3's is 448: 16 tokens a tile here instead of 256


def qwen2_5_vl_config(tokenizer):
    text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                mrope_section=[8, 12, 12])
    # Qwen2.5-VL-7B: windows of 112 pixels, every 8th block attends over the whole image
    vision = dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, fullatt_block_indexes=[1, 3])
    return _qwen2_5_vl(tokenizer, text, vision)


def qwen2_5_vl_7b_widths_config(tokenizer):
    """Qwen2.5-VL-7B's tensor widths (text hidden 3584 in 28 heads of 128, 4
    KV heads; ViT 1280 wide in 16 heads, merged to 3584) with one text layer
    and two vision blocks (one windowed, one full). Visual tokens, transfers
    and serialisation then cost what they cost with the real checkpoint (a
    megapixel image: about 1,300 tokens, 9 MB in bf16), while two cores can
    still run it."""
    text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=1, num_attention_heads=28, num_key_value_heads=4,
                mrope_section=[16, 24, 24])
    vision = dict(depth=2, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, fullatt_block_indexes=[1])
    return _qwen2_5_vl(tokenizer, text, vision)


def _qwen2_5_vl(tokenizer, text: dict, vision: dict):
    """A Qwen2.5-VL config of the given widths, with the demo tokenizer's ids."""
    from transformers import Qwen2_5_VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    mrope_section = text.pop("mrope_section")
    text = dict(
        text, vocab_size=len(tokenizer), max_position_embeddings=32768,
        rope_scaling={"type": "mrope", "mrope_section": mrope_section, "rope_theta": 1000000.0},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False,
    )
    vision = dict(vision, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu", window_size=112)
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )


def write_qwen2_5_vl(out: Path, seed: int = SEED, max_pixels: int = DEFAULT_MAX_PIXELS) -> Path:
    from transformers import Qwen2_5_VLForConditionalGeneration

    configs = processor_configs(max_pixels, DEFAULT_MIN_PIXELS, processor="Qwen2_5_VLProcessor")
    return _write_qwen(out, seed, Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_config, configs, "qwen2.5-vl")


def write_qwen2_5_vl_7b_widths(out: Path, seed: int = SEED, max_pixels: int = DEFAULT_MAX_PIXELS) -> Path:
    from transformers import Qwen2_5_VLForConditionalGeneration

    configs = processor_configs(max_pixels, DEFAULT_MIN_PIXELS, processor="Qwen2_5_VLProcessor")
    return _write_qwen(out, seed, Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_7b_widths_config, configs, "qwen2.5-vl-7b-widths")


def _write_qwen(out: Path, seed: int, model_class, config, processor_configs: tuple[dict, dict], family: str,
                device: str = "cpu") -> Path:
    """A Qwen-family checkpoint: weights, the demo tokenizer, image and video processor configs
    (built on `device`: a GPU builds a real-width tower in seconds)."""
    import torch

    tokenizer = build_tokenizer(seed)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config(tokenizer)).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    image, video = processor_configs
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return _finish(out, seed, family)


def qwen3_vl_config(tokenizer):
    from transformers import Qwen3VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=32768,
        rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12], "mrope_interleaved": True, "rope_theta": 5000000.0},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False,
    )
    vision = dict(
        depth=3, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=576,
        deepstack_visual_indexes=[0, 1],  # two DeepStack layers: embeddings are 3 × 128 wide
    )
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )


def qwen3_vl_processor_configs(max_pixels: int, min_pixels: int) -> tuple[dict, dict]:
    return processor_configs(
        max_pixels, min_pixels, patch_size=16, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5],
        image_processor="Qwen2VLImageProcessorFast", processor="Qwen3VLProcessor", video_processor="Qwen3VLVideoProcessor",
    )


def write_qwen3_vl(out: Path, seed: int = SEED, max_pixels: int = DEFAULT_MAX_PIXELS) -> Path:
    from transformers import Qwen3VLForConditionalGeneration

    configs = qwen3_vl_processor_configs(max_pixels, QWEN3_VL_MIN_PIXELS)
    return _write_qwen(out, seed, Qwen3VLForConditionalGeneration, qwen3_vl_config, configs, "qwen3-vl")


def tiny_qwen2_text(tokenizer) -> dict:
    """The language model of the LLaVA, InternVL and text-only checkpoints: Qwen2, head size 64."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    return dict(
        model_type="qwen2", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=32768,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False,
    )


def onevision_config(tokenizer):
    from transformers import LlavaOnevisionConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = tiny_qwen2_text(tokenizer)
    vision = dict(
        model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, image_size=ONEVISION_TILE, patch_size=ONEVISION_PATCH,
    )
    return LlavaOnevisionConfig(
        text_config=text, vision_config=vision, image_token_index=ids["<|image_pad|>"],
        video_token_index=ids["<|video_pad|>"], vision_feature_layer=-1, vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9", image_grid_pinpoints=onevision_pinpoints(), tie_word_embeddings=False,
    )


def onevision_pinpoints() -> list[list[int]]:
    """LLaVA-OneVision's: every grid of 1 to 6 tiles a side."""
    return [[ONEVISION_TILE * rows, ONEVISION_TILE * cols] for rows in range(1, 7) for cols in range(1, 7)]


def _save_llava(model, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 saves SigLIP and CLIP without the `vision_model.` level that
    # the published checkpoints (llava-hf/*) have and vLLM loads: put it back.
    weights = load_file(out / "model.safetensors")
    renamed = {f"vision_tower.vision_model.{k.removeprefix('vision_tower.')}" if k.startswith("vision_tower.") else k: v
               for k, v in weights.items()}
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})


def _finish(out: Path, seed: int, family: str, template: str = CHAT_TEMPLATE) -> Path:
    (out / "chat_template.jinja").write_text(template)
    # A sampling default as real checkpoints ship them (Qwen3-VL's sets top_k 20):
    # top_k 1 makes sampling greedy, so a test can see that it was applied.
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**generation, "top_k": 1}, indent=2))
    (out / "prism_demo.json").write_text(json.dumps({"seed": seed, "kind": "random-weights", "family": family}, indent=2) + "\n")
    return out


def write_onevision(out: Path, seed: int = SEED) -> Path:
    import torch
    from transformers import (
        LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessor, LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = build_tokenizer(seed)
    torch.manual_seed(seed)
    _save_llava(LlavaOnevisionForConditionalGeneration(onevision_config(tokenizer)).to(torch.bfloat16), out)
    size = {"height": ONEVISION_TILE, "width": ONEVISION_TILE}
    image = LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=onevision_pinpoints(), image_mean=[0.5] * 3,
                                         image_std=[0.5] * 3, do_pad=True)
    video = LlavaOnevisionVideoProcessor(size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    LlavaOnevisionProcessor(
        image_processor=image, video_processor=video, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
        num_image_tokens=(ONEVISION_TILE // ONEVISION_PATCH) ** 2, vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9", image_token="<|image_pad|>", video_token="<|video_pad|>",
    ).save_pretrained(out)
    return _finish(out, seed, "llava-onevision")


def next_config(tokenizer):
    from transformers import LlavaNextConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = tiny_qwen2_text(tokenizer)
    vision = dict(
        model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, image_size=ONEVISION_TILE, patch_size=ONEVISION_PATCH, projection_dim=64,
    )
    return LlavaNextConfig(
        text_config=text, vision_config=vision, image_token_index=ids["<|image_pad|>"], vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_grid_pinpoints=next_pinpoints(), tie_word_embeddings=False,
    )


def next_pinpoints() -> list[list[int]]:
    """LLaVA-NeXT's five (336 × 672, 672 × 336, 672², 1008 × 336, 336 × 1008), at the tiny tile."""
    return [[ONEVISION_TILE * rows, ONEVISION_TILE * cols] for rows, cols in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


def write_next(out: Path, seed: int = SEED) -> Path:
    import torch
    from transformers import LlavaNextForConditionalGeneration, LlavaNextImageProcessor, LlavaNextProcessor

    tokenizer = build_tokenizer(seed)
    torch.manual_seed(seed)
    _save_llava(LlavaNextForConditionalGeneration(next_config(tokenizer)).to(torch.bfloat16), out)
    image = LlavaNextImageProcessor(
        size={"shortest_edge": ONEVISION_TILE}, crop_size={"height": ONEVISION_TILE, "width": ONEVISION_TILE},
        image_grid_pinpoints=next_pinpoints(), image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )
    LlavaNextProcessor(
        image_processor=image, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE, patch_size=ONEVISION_PATCH,
        vision_feature_select_strategy="default", image_token="<|image_pad|>", num_additional_image_tokens=1,
    ).save_pretrained(out)
    return _finish(out, seed, "llava-next")


def internvl_tokenizer(seed: int):
    """The demo tokenizer, naming its image tokens as InternVL's processor looks them up."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(seed)
    return PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], chat_template=CHAT_TEMPLATE, model_max_length=8192,
        extra_special_tokens={"start_image_token": "<|vision_start|>", "end_image_token": "<|vision_end|>",
                              "context_image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )


def internvl_config(tokenizer):
    from transformers import InternVLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = tiny_qwen2_text(tokenizer)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=[INTERNVL_TILE] * 2, patch_size=[14, 14])
    return InternVLConfig(
        vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"], downsample_ratio=0.5,
        vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )


def write_internvl(out: Path, seed: int = SEED) -> Path:
    import torch
    from transformers import GotOcr2ImageProcessor, InternVLForConditionalGeneration, InternVLProcessor, InternVLVideoProcessor

    tokenizer = internvl_tokenizer(seed)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(internvl_config(tokenizer)).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    size = {"height": INTERNVL_TILE, "width": INTERNVL_TILE}
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # InternVL3's
    image = GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1, max_patches=12, image_mean=mean, image_std=std)
    video = InternVLVideoProcessor(size=size, image_mean=mean, image_std=std)
    InternVLProcessor(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=CHAT_TEMPLATE,
        image_seq_length=(INTERNVL_TILE // 14) ** 2 // 4,
    ).save_pretrained(out)
    return _finish(out, seed, "internvl3")


def write_text_only(out: Path, seed: int = SEED) -> Path:
    return _write_qwen2_text(out, seed, build_tokenizer(seed), "qwen2-text")


def write_thinking(out: Path, seed: int = SEED) -> Path:
    """The text-only checkpoint as a thinking model: Qwen3's <think> and </think> (added tokens
    that are not special, so they stay in the text, as Qwen3's tokenizer has them), and a template
    whose answer opens inside <think>. Served with vLLM's qwen3 reasoning parser."""
    tokenizer = build_tokenizer(seed)
    tokenizer.add_tokens(THINKING_TOKENS)
    tokenizer.chat_template = THINKING_CHAT_TEMPLATE
    return _write_qwen2_text(out, seed, tokenizer, "qwen2-thinking")


def _write_qwen2_text(out: Path, seed: int, tokenizer, family: str) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text = {k: v for k, v in tiny_qwen2_text(tokenizer).items() if k != "model_type"}
    config = Qwen2Config(**text, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return _finish(out, seed, family, tokenizer.chat_template)


BUILDERS = {
    "qwen2.5-vl": (write_qwen2_5_vl, QWEN2_5_VL_MODEL),
    "qwen2.5-vl-7b-widths": (write_qwen2_5_vl_7b_widths, QWEN2_5_VL_7B_WIDTHS_MODEL),
    "qwen3-vl": (write_qwen3_vl, QWEN3_VL_MODEL),
    "llava-onevision": (write_onevision, ONEVISION_MODEL),
    "llava-next": (write_next, NEXT_MODEL),
    "internvl3": (write_internvl, INTERNVL_MODEL),
    "qwen2-text": (write_text_only, TEXT_MODEL),
    "qwen2-thinking": (write_thinking, THINKING_MODEL),
}
TEMPLATES = {"qwen2-thinking": THINKING_CHAT_TEMPLATE}  # the others': CHAT_TEMPLATE


def ensure_tiny_model(family: str, out: Path | None = None) -> Path:
    """Write the family's tiny checkpoint unless a complete one is already there."""
    write, default = BUILDERS[family]
    out = out or default
    if (out / "prism_demo.json").exists():
        refresh_chat_template(out, TEMPLATES.get(family, CHAT_TEMPLATE))
        return out
    return write(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(BUILDERS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    write, default = BUILDERS[args.family]
    print(write(args.out or default, args.seed))


if __name__ == "__main__":
    main()
