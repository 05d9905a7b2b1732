"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: images of different resolutions packed
into one forward pass (a flat sequence of patches plus each image's (t, h, w)
grid; the towers attend within images). The output is the merger's tokens,
followed along the hidden axis for Qwen3-VL by each DeepStack feature.

What the forward derives from the grids alone (rotary positions, segment
bounds, Qwen2.5-VL's window order, Qwen3-VL's position-embedding taps) is
computed on the preprocessing thread with transformers' own helpers
(`transformers.vision_utils`) and handed to the forward, which pops them
from its kwargs: the forward then never waits on the host (a CUDA graph can
hold it: vision_encoder/towers/graphs.py), and attention runs as one packed call
per layer (vision_encoder/towers/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.families import Family
from protocol.to_gateway import ProcessorInfo
from vision_encoder.towers import attention
from vision_encoder.towers.fused_patches import channels_first_view, fuse_normalize_into_patchify
from vision_encoder.towers.graphs import TowerGraphs
from vision_encoder.towers.tower import RunOptions, TowerImage, VisionTower

# Key prefixes of the vision weights: transformers >= 4.52 saves `model.visual.`,
# the original Qwen2-VL / Qwen2.5-VL checkpoints use `visual.`.
@dataclass(frozen=True)
class Preprocessed:
    pixel_values: torch.Tensor  # (Σ patches, C·T·P·P), already in the tower's dtype (on the device if preprocessed there)
    grid_thw: torch.Tensor  # (n_images, 3), on the host
    plan: dict[str, Any] = field(default_factory=dict)  # the forward's precomputed kwargs (plan_of), on the host
    ready: Any = None  # the preprocessing stream's event (CUDA), see DeviceIO

    @property
    def patches(self) -> int:
        return self.pixel_values.shape[0]


def plan_of(model: torch.nn.Module, grid_thw: torch.Tensor) -> dict[str, Any]:
    """What the tower's forward would derive from `grid_thw`, by transformers'
    own helpers; each key is one the forward pops from its kwargs."""
    from transformers import vision_utils as vu

    def longest(cu: torch.Tensor) -> int:
        return int((cu[1:] - cu[:-1]).max())

    merge = model.spatial_merge_size
    cu = vu.get_vision_cu_seqlens(grid_thw)
    plan: dict[str, Any] = {"position_ids": vu.get_vision_position_ids(grid_thw, merge), "cu_seqlens": cu, "max_seqlen": longest(cu)}
    if getattr(model, "window_size", None):  # Qwen2.5-VL's windowed blocks
        window_index, cu_windows = vu.get_vision_window_index(grid_thw, merge, model.window_size, model.patch_size)
        plan.update(window_index=window_index, cu_window_seqlens=cu_windows, max_window_seqlen=longest(cu_windows))
    if getattr(model, "num_grid_per_side", None):  # Qwen3-VL's learned position embedding, resampled per grid
        indices, weights = vu.get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=model.num_grid_per_side, mode=model.interpolation_mode,
            align_corners=model.interpolation_align_corners, spatial_merge_size=merge,
        )
        plan.update(interp_indices=indices, interp_weights=weights)
    return plan


def _in_order(parts: dict[bool, tuple[torch.Tensor, torch.Tensor]], sized: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two processor calls' (pixels, grids), resized and not, put back in the batch's order."""
    chunks = {flag: iter(zip(pixels.split(grids.prod(dim=1).tolist()), grids)) for flag, (pixels, grids) in parts.items()}
    ordered = [next(chunks[flag]) for flag in sized]
    return torch.cat([pixels for pixels, _ in ordered]), torch.stack([grid for _, grid in ordered])


class QwenTower(VisionTower):
    def __init__(self, model_id: str, path: Path, config: Any, family: Family, dtype: str, device: str,
                 min_pixels: int | None = None, max_pixels: int | None = None, options: RunOptions = RunOptions()) -> None:
        from transformers import AutoImageProcessor

        super().__init__(model_id, config, family, dtype, device, options)
        self.merge_size = config.vision_config.spatial_merge_size
        overrides = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
        # The deployment's budget, which vLLM's `mm_processor_kwargs` applies to videos too (qwen_video.py)
        self.pixel_budget = dict(overrides)
        if overrides:
            # Qwen processors read both spellings; `size` is the one they resize by.
            overrides["size"] = {"shortest_edge": overrides.get("min_pixels"), "longest_edge": overrides.get("max_pixels")}
        self.processor = AutoImageProcessor.from_pretrained(path, **overrides)
        self._load(path, config)
        fuse_normalize_into_patchify(self.processor, self.dtype)  # the same patches, fewer copies
        self.attention = attention.choose(options.attention, self.device, self.dtype)
        self.model.config._attn_implementation = attention.register(self.attention)
        self.graphs = None
        if options.graph_max_patches and self.device.type == "cuda" and self.attention != "loop":
            self.graphs = self._capture_graphs(options)

    def arithmetic_params(self) -> dict:
        """Its attention kernel, and the patch counts its CUDA graphs pad batches to."""
        return super().arithmetic_params() | {
            "attention": self.attention, "graph_max_patches": self.options.graph_max_patches if self.graphs else 0}

    def _capture_graphs(self, options: RunOptions) -> TowerGraphs:
        info = self.processor_info
        graphs = TowerGraphs(self.model, self._forward, options.graph_max_patches, options.max_batch_images,
                             longest_image=info.max_pixels // info.patch_size**2)
        side = 2 * info.merge_size  # the example: one small image, padded to each bucket
        grid = torch.tensor([[1, side, side]])
        width = 3 * self.processor.temporal_patch_size * info.patch_size**2
        graphs.capture(torch.zeros(side * side, width, dtype=self.dtype), plan_of(self.model, grid), self.device)
        return graphs

    def vision_weight(self, name: str) -> str | None:
        return name.removeprefix("model.").removeprefix("visual.") if self.family.is_vision_weight(name) else None

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
            video_processor="Qwen3VLVideoProcessor" if self.family.name == "Qwen3-VL" else "Qwen2VLVideoProcessor",
        )

    def family_params(self) -> dict:
        p = self.processor
        return {"patch_size": p.patch_size, "temporal_patch_size": p.temporal_patch_size, "merge_size": p.merge_size}

    def num_patches(self, height: int, width: int) -> int:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        info = self.processor_info
        h, w = smart_resize(height, width, info.patch_size * info.merge_size, info.min_pixels, info.max_pixels)
        return (h // info.patch_size) * (w // info.patch_size)

    def gateway_sized(self, image: TowerImage) -> bool:
        """The gateway sent the image at the size vLLM's processor makes of the original under
        the request's budget (it says so; a sender that does not, resized it to the grid). Sizing
        it again would apply the deployment's budget (a request's own, or `detail: low`, may be
        smaller) and smart_resize's checks to a size they were not meant for: its rounding can
        land outside the budget it was given, and a rounded-up short side can push the aspect
        ratio past the 200 it refuses."""
        height, width = image.pixels.shape[:2]
        factor = self.processor.patch_size * self.processor.merge_size
        on_grid = height % factor == 0 and width % factor == 0
        return on_grid and (image.sized or (height, width) != tuple(image.original_size))

    def patches_of(self, image: TowerImage) -> int:
        if not self.gateway_sized(image):
            return super().patches_of(image)
        height, width = image.pixels.shape[:2]
        return (height // self.processor.patch_size) * (width // self.processor.patch_size)

    def preprocess(self, images: list[TowerImage]) -> Preprocessed:
        sized = [self.gateway_sized(image) for image in images]
        with self.io.preparing():
            parts = {flag: self._process([image for image, s in zip(images, sized) if s == flag], resize=not flag)
                     for flag in set(sized)}
            pixels, grid_thw = parts[sized[0]] if len(parts) == 1 else _in_order(parts, sized)
            pixels = pixels.to(self.dtype)
            ready = self.io.prepared()
        return Preprocessed(pixels, grid_thw, plan_of(self.model, grid_thw), ready)

    def _process(self, images: list[TowerImage], resize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.processor(images=[channels_first_view(image.pixels) for image in images], input_data_format="channels_first",
                             return_tensors="pt", **({} if resize else {"do_resize": False}), **self.processor_device)
        return out["pixel_values"], out["image_grid_thw"].cpu()

    def _forward(self, pixels: torch.Tensor, plan: dict[str, Any]) -> torch.Tensor:
        """The tower on device inputs: the merger's tokens (+ DeepStack features), one row per token."""
        out = self.model(pixels, grid_thw=None, **plan)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1) if self.family.deepstack else out.pooler_output

    @torch.inference_mode()
    def encode(self, batch: Preprocessed) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        self.io.wait_for(batch.ready, [batch.pixel_values])
        pixels = self.io.to_device(batch.pixel_values)
        tokens = self.graphs.run(pixels, batch.plan) if self.graphs is not None else None
        if tokens is None:  # no graph holds this batch (or none are captured): run it as it comes
            plan = {k: self.io.to_device(v) if isinstance(v, torch.Tensor) else v for k, v in batch.plan.items()}
            tokens = self._forward(pixels, plan)
        merged = self.io.to_host(tokens)
        grids = [tuple(int(x) for x in row) for row in batch.grid_thw.tolist()]
        sizes = [t * h * w // self.merge_size**2 for t, h, w in grids]
        return list(zip(merged.split(sizes), grids))
