"""Checkpoints whose vision towers are the real ones, full depth and width, with
random weights and a one-layer language model of the real hidden size (the
projector's output width): what `bench.gpu_encoder` measures.

| name | tower | as in |
|---|---|---|
| qwen2.5-vl-7b | Qwen2.5-VL ViT, 32 blocks × 1280, windows of 112 px, full attention in 7/15/23/31 | Qwen2.5-VL-7B-Instruct |
| qwen3-vl-8b | Qwen3-VL ViT, 27 blocks × 1152, patch 16, DeepStack at 8/16/24 | Qwen3-VL-8B-Instruct |
| llava-onevision-7b | SigLIP-so400m, 26 layers × 1152, tiles of 384 | llava-onevision-qwen2-7b-ov-hf |
| internvl3-8b | InternViT-300M, 24 layers × 1024, tiles of 448 | InternVL3-8B-hf |

Built on the device they run on (seconds on a GPU). The FLOPs of a batch
(`batch_flops`) are counted from what actually runs: the matrix products by
torch's FlopCounterMode, attention from the segments each layer attends over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from prism import tiny_models as tm
from prism.demo_model import CHAT_TEMPLATE, SEED, SPECIAL_TOKENS, build_tokenizer, processor_configs

QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 200704, 1003520  # configs/qwen2.5-vl-7b.yaml's budget


def pixel_budget(name: str) -> tuple[int | None, int | None]:
    """`load_tower`'s min_pixels / max_pixels for a tower here: the Qwen budget for Qwen's, none for the tiled families."""
    return (QWEN_MIN_PIXELS, QWEN_MAX_PIXELS) if name.startswith("qwen") else (None, None)


def _ids(tokenizer) -> dict[str, int]:
    return {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}


def _qwen2_text(tokenizer, hidden: int, heads: int, kv_heads: int) -> dict:
    ids = _ids(tokenizer)
    return dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=32768, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                tie_word_embeddings=False)


def qwen2_5_vl_7b(tokenizer):
    config = tm.qwen2_5_vl_7b_widths_config(tokenizer)
    config.vision_config.depth = 32
    config.vision_config.fullatt_block_indexes = [7, 15, 23, 31]
    return config


def qwen3_vl_8b(tokenizer):
    from transformers import Qwen3VLConfig

    ids = _ids(tokenizer)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=4096, intermediate_size=12288, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True, "rope_theta": 5000000.0},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False,
    )
    vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=4096, num_position_embeddings=2304,
                  deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )


def write_qwen2_5_vl_7b(out: Path, device: str) -> Path:
    from transformers import Qwen2_5_VLForConditionalGeneration

    configs = processor_configs(QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, processor="Qwen2_5_VLProcessor")
    return tm._write_qwen(out, SEED, Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_7b, configs, "qwen2.5-vl-7b", device)


def write_qwen3_vl_8b(out: Path, device: str) -> Path:
    from transformers import Qwen3VLForConditionalGeneration

    configs = tm.qwen3_vl_processor_configs(QWEN_MAX_PIXELS, QWEN_MIN_PIXELS)
    return tm._write_qwen(out, SEED, Qwen3VLForConditionalGeneration, qwen3_vl_8b, configs, "qwen3-vl-8b", device)


def write_onevision_7b(out: Path, device: str) -> Path:
    from transformers import (
        LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessor, LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tile = 384
    tokenizer = build_tokenizer(SEED)
    ids = _ids(tokenizer)
    pinpoints = [[tile * rows, tile * cols] for rows in range(1, 7) for cols in range(1, 7)]
    vision = dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
                  num_attention_heads=16, image_size=tile, patch_size=14)
    config = LlavaOnevisionConfig(
        text_config=_qwen2_text(tokenizer, 3584, 28, 4), vision_config=vision, image_token_index=ids["<|image_pad|>"],
        video_token_index=ids["<|video_pad|>"], vision_feature_layer=-1, vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9", image_grid_pinpoints=pinpoints, tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    with torch.device(device):
        model = LlavaOnevisionForConditionalGeneration(config).to(torch.bfloat16)
    tm._save_llava(model, out)
    size = {"height": tile, "width": tile}
    mean = std = [0.5] * 3
    image = LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=pinpoints, image_mean=mean, image_std=std, do_pad=True)
    video = LlavaOnevisionVideoProcessor(size=size, image_mean=mean, image_std=std)
    LlavaOnevisionProcessor(
        image_processor=image, video_processor=video, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
        num_image_tokens=(tile // 14) ** 2, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
        image_token="<|image_pad|>", video_token="<|video_pad|>",
    ).save_pretrained(out)
    return tm._finish(out, SEED, "llava-onevision-7b")


def write_internvl3_8b(out: Path, device: str) -> Path:
    from transformers import (
        GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration, InternVLProcessor, InternVLVideoProcessor,
    )

    tile = 448
    tokenizer = tm.internvl_tokenizer(SEED)
    ids = _ids(tokenizer)
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=[tile, tile], patch_size=[14, 14])
    config = InternVLConfig(
        vision_config=vision, text_config=_qwen2_text(tokenizer, 3584, 28, 4), image_token_id=ids["<|image_pad|>"],
        downsample_ratio=0.5, vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    with torch.device(device):
        model = InternVLForConditionalGeneration(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    size = {"height": tile, "width": tile}
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    image = GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1, max_patches=12, image_mean=mean, image_std=std)
    video = InternVLVideoProcessor(size=size, image_mean=mean, image_std=std)
    InternVLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=CHAT_TEMPLATE,
                      image_seq_length=(tile // 14) ** 2 // 4).save_pretrained(out)
    return tm._finish(out, SEED, "internvl3-8b")


WRITERS = {
    "qwen2.5-vl-7b": write_qwen2_5_vl_7b,
    "qwen3-vl-8b": write_qwen3_vl_8b,
    "llava-onevision-7b": write_onevision_7b,
    "internvl3-8b": write_internvl3_8b,
}


# --tiny: the same families' tiny checkpoints (prism/tiny_models.py), a CPU smoke run of the bench; and
# qwen2.5-vl-7b-widths, Qwen2.5-VL-7B's tower at its real widths with two blocks (one windowed, one full),
# the CPU's real-width profile.
TINY = {"qwen2.5-vl-7b": "qwen2.5-vl", "qwen3-vl-8b": "qwen3-vl", "llava-onevision-7b": "llava-onevision",
        "internvl3-8b": "internvl3", "qwen2.5-vl-7b-widths": "qwen2.5-vl-7b-widths"}


def ensure(name: str, root: Path, device: str, tiny: bool = False) -> Path:
    if tiny:
        return tm.ensure_tiny_model(TINY[name])
    out = root / name
    if not (out / "prism_demo.json").exists():
        WRITERS[name](out, device)
    return out


# ---------------------------------------------------------------- FLOPs
def _attention_flops(tower, batch) -> float:
    """QKᵀ and AV: 4 · hidden · Σ segment² per layer, over the segments each layer attends within."""
    vc = tower.model.config
    if hasattr(batch, "plan"):  # Qwen: whole images in the full-attention blocks, windows in the others
        def squares(cu: torch.Tensor) -> float:
            return float(((cu[1:] - cu[:-1]).double() ** 2).sum())

        full_layers = len(vc.fullatt_block_indexes) if "cu_window_seqlens" in batch.plan else vc.depth
        windowed = vc.depth - full_layers
        total = full_layers * squares(batch.plan["cu_seqlens"])
        if windowed:
            total += windowed * squares(batch.plan["cu_window_seqlens"])
        return 4.0 * vc.hidden_size * total
    vision = vc.vision_config
    side = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
    patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
    tokens = (side // patch) ** 2 + (1 if vision.model_type.startswith("internvl") else 0)  # InternViT's class token
    return 4.0 * vision.hidden_size * tokens**2 * vision.num_hidden_layers * _tiles_run(tower, batch)


def _tiles_run(tower, batch) -> int:
    if hasattr(batch, "tiles"):
        return sum(batch.tiles)
    grid = tower.layout.tile_grid**2
    return sum(tower.num_patches(h, w) // grid for h, w in batch.image_sizes.tolist())


def batch_flops(tower, batch) -> float:
    """One forward's FLOPs: matrix products as run, plus attention (see the module docstring).

    Counted with compiled blocks run eagerly: dynamo meeting a compiled frame
    under a dispatch mode (the FLOP counter is one) skips that frame's code
    for good, and every later forward in the process would run eagerly."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
        tower.encode(batch)
    # attention by its own count (torch's varlen op, torch_attn._varlen_attn, registers FLOPs of its own in newer torch)
    products = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "attention" not in str(op) and "attn" not in str(op))
    return products + _attention_flops(tower, batch)


def describe(tower) -> dict[str, Any]:
    params = sum(p.numel() for p in tower.model.parameters())
    return {"family": tower.family.name, "params_m": round(params / 1e6, 1), "dtype": str(tower.dtype),
            "attention": getattr(tower, "attention", "sdpa"), "processor": type(tower.processor).__name__}
