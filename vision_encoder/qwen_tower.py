"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: images of different resolutions packed
into one forward pass (a flat sequence of patches plus each image's (t, h, w)
grid; the towers attend within images). The output is the merger's tokens,
followed along the hidden axis for Qwen3-VL by each DeepStack feature."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.families import Family
from protocol.to_gateway import ProcessorInfo
from vision_encoder.tower import TowerImage, VisionTower

# Key prefixes of the vision weights: transformers >= 4.52 saves `model.visual.`,
# the original Qwen2-VL / Qwen2.5-VL checkpoints use `visual.`.
_VISION_PREFIXES = ("model.visual.", "visual.")


@dataclass(frozen=True)
class Preprocessed:
    pixel_values: torch.Tensor  # (Σ patches, C·T·P·P), already in the tower's dtype
    grid_thw: torch.Tensor  # (n_images, 3)


class QwenTower(VisionTower):
    def __init__(self, model_id: str, path: Path, config: Any, family: Family, dtype: str, device: str,
                 min_pixels: int | None = None, max_pixels: int | None = None) -> None:
        from transformers import AutoImageProcessor

        super().__init__(model_id, config, family, dtype, device)
        self.merge_size = config.vision_config.spatial_merge_size
        overrides = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
        if overrides:
            # Qwen processors read both spellings; `size` is the one they resize by.
            overrides["size"] = {"shortest_edge": overrides.get("min_pixels"), "longest_edge": overrides.get("max_pixels")}
        self.processor = AutoImageProcessor.from_pretrained(path, **overrides)
        self._load(path, config)

    def vision_weight(self, name: str) -> str | None:
        prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
        return None if prefix is None else name[len(prefix):]

    def _module(self, config: Any) -> torch.nn.Module:
        _, tower = self._vision_code(config)
        return tower._from_config(config.vision_config, dtype=self.dtype)

    @property
    def processor_info(self) -> ProcessorInfo:
        size = self.processor.size
        return ProcessorInfo(
            patch_size=self.processor.patch_size,
            merge_size=self.processor.merge_size,
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
        )

    def family_params(self) -> dict:
        p = self.processor
        return {"patch_size": p.patch_size, "temporal_patch_size": p.temporal_patch_size, "merge_size": p.merge_size}

    def num_patches(self, height: int, width: int) -> int:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        info = self.processor_info
        h, w = smart_resize(height, width, info.patch_size * info.merge_size, info.min_pixels, info.max_pixels)
        return (h // info.patch_size) * (w // info.patch_size)

    def preprocess(self, images: list[TowerImage]) -> Preprocessed:
        out = self.processor(images=[image.pixels for image in images], return_tensors="pt")
        return Preprocessed(out["pixel_values"].to(self.dtype), out["image_grid_thw"])

    @torch.inference_mode()
    def encode(self, batch: Preprocessed) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        pixels = batch.pixel_values.to(self.device)
        out = self.model(pixels, grid_thw=batch.grid_thw.to(self.device))
        # Qwen3-VL: each DeepStack layer's feature beside the merger's tokens, as vLLM takes them
        merged = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1) if self.family.deepstack else out.pooler_output
        grids = [tuple(int(x) for x in row) for row in batch.grid_thw.tolist()]
        sizes = [t * h * w // self.merge_size**2 for t, h, w in grids]
        return [(t.to("cpu").contiguous(), g) for t, g in zip(merged.split(sizes), grids)]
