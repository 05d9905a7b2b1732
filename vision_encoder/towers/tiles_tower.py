"""InternVL3 (Hugging Face format): InternViT over each image's tiles (the
grid closest to its aspect ratio, plus a thumbnail; common/tiles.py), pixel
shuffle, then the projector. One token list per image, tiles × tokens per
tile long: vLLM takes the lists as they are.

The gateway sends an image scaled down (aspect kept) to the smallest size
that still covers its canvas, beside the original size. The grid is chosen
here from the original size, as vLLM's processor chooses it on the raw image,
and the processor is then held to that many tiles: it finds the same grid in
the smaller image (the aspect ratio is the same; a unit test checks 100,000
sizes).

The forward is transformers' own `InternVLModel.get_image_features`, run on a
module that holds only the two vision parts it uses (the ViT and the
projector), so the language model is never built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.families import Family
from common.tiles import TileLayout
from protocol.to_gateway import TilesInfo
from vision_encoder.towers.tower import RunOptions, TowerImage, VisionTower

@dataclass(frozen=True)
class Preprocessed:
    pixel_values: torch.Tensor  # (Σ tiles, 3, tile, tile), in the tower's dtype
    tiles: list[int]  # per image
    ready: Any = None  # the preprocessing stream's event (CUDA), see DeviceIO


def tokens_per_tile(config: Any) -> int:
    patches = (config.vision_config.image_size[0] // config.vision_config.patch_size[0]) ** 2
    return int(patches * config.downsample_ratio**2)


class TilesTower(VisionTower):
    def __init__(self, model_id: str, path: Path, config: Any, family: Family, dtype: str, device: str,
                 min_pixels: int | None = None, max_pixels: int | None = None, options: RunOptions = RunOptions()) -> None:
        from transformers import AutoImageProcessor

        self.refuse_pixel_budget(family, min_pixels, max_pixels, "tiles each image by its aspect ratio")
        super().__init__(model_id, config, family, dtype, device, options)
        self.processor = p = AutoImageProcessor.from_pretrained(path)
        if p.size["height"] != p.size["width"]:
            raise ValueError(f"image processor size {dict(p.size)}: only square tiles are served")
        self.layout = TileLayout(p.size["height"], p.min_patches, p.max_patches, bool(p.crop_to_patches), tokens_per_tile(config))
        self._check_sequence_length(path)
        self.feature_layer = config.vision_feature_layer
        self.select_strategy = config.vision_feature_select_strategy
        self._load(path, config)

    def _check_sequence_length(self, path: Path) -> None:
        """vLLM counts an image's tokens with the processor's `image_seq_length`; the tower makes
        (tile / patch)² × downsample² per tile. A checkpoint where they differ cannot be served."""
        saved = path / "processor_config.json"
        length = json.loads(saved.read_text()).get("image_seq_length") if saved.exists() else None
        if length is not None and length != self.layout.tokens_per_tile:
            raise ValueError(f"processor_config.json image_seq_length {length} but the vision config makes "
                             f"{self.layout.tokens_per_tile} tokens per tile")

    def vision_weight(self, name: str) -> str | None:
        return name.removeprefix("model.") if self.family.is_vision_weight(name) else None

    def _module(self, config: Any) -> torch.nn.Module:
        source, model = self._vision_code(config)
        from transformers import AutoModel

        class TilesVision(torch.nn.Module):
            get_image_features = model.get_image_features
            pixel_shuffle = model.pixel_shuffle

            def __init__(self) -> None:
                super().__init__()
                self.config = config
                self.vision_tower = AutoModel.from_config(config.vision_config)
                self.multi_modal_projector = source.InternVLMultiModalProjector(config)

            @property
            def dtype(self) -> torch.dtype:  # read by get_image_features
                return self.multi_modal_projector.linear_1.weight.dtype

        return TilesVision()

    @property
    def processor_info(self) -> TilesInfo:
        layout = self.layout
        return TilesInfo(layout.tile_size, layout.min_tiles, layout.max_tiles, layout.crop, layout.tokens_per_tile)

    def family_params(self) -> dict:
        p = self.processor
        return {
            "crop_to_patches": bool(p.crop_to_patches),
            "min_patches": p.min_patches,
            "max_patches": p.max_patches,
            "vision_feature_layer": self.feature_layer,
            "vision_feature_select_strategy": self.select_strategy,
            "tokens_per_tile": self.layout.tokens_per_tile,
        }

    def num_patches(self, height: int, width: int) -> int:
        return self.layout.tiles(height, width) * (self.layout.tile_size // self.model.config.vision_config.patch_size[0]) ** 2

    def preprocess(self, images: list[TowerImage]) -> Preprocessed:
        pixels, tiles = [], []
        with self.io.preparing():
            for image in images:  # each image held to its own tile count: one processor call each
                count = self.layout.tiles(*image.original_size)
                crops = count - 1 if count > 1 else 1
                out = self.processor(images=[image.pixels], min_patches=crops, max_patches=crops, input_data_format="channels_last",
                                     return_tensors="pt", **self.processor_device)  # said, not guessed: (3, w, 3) is ambiguous
                if out["pixel_values"].shape[0] != count:
                    raise ValueError(f"image of original size {image.original_size}: {out['pixel_values'].shape[0]} tiles, expected {count}")
                pixels.append(out["pixel_values"].to(self.dtype))
                tiles.append(count)
            batch = torch.cat(pixels)
            ready = self.io.prepared()
        return Preprocessed(batch, tiles, ready)

    @torch.inference_mode()
    def encode(self, batch: Preprocessed) -> list[tuple[torch.Tensor, None]]:
        self.io.wait_for(batch.ready, [batch.pixel_values])
        out = self.model.get_image_features(
            self.io.to_device(batch.pixel_values),
            vision_feature_layer=self.feature_layer, vision_feature_select_strategy=self.select_strategy,
        )
        features = self.io.to_host(out.pooler_output)  # (Σ tiles, tokens per tile, hidden), one copy down
        return [(f.reshape(-1, f.shape[-1]), None) for f in features.split(batch.tiles)]
