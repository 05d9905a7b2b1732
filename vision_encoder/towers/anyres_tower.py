"""LLaVA-OneVision and LLaVA-NeXT: the ViT (SigLIP, CLIP) over each image's
tiles (its best grid pinpoint, cut into tiles, after a base tile of the whole
image), the projector, then the tiles' features stitched, unpadded, shrunk
to `max_tiles` (OneVision) and given a newline token per row
(common/anyres.py). One token list per image, of a length that depends on its
size: vLLM takes the lists as they are.

The forward is transformers' own `get_image_features` of the family's model
class (`LlavaOnevisionModel`, `LlavaNextModel`), run on a module that holds
only the three vision parts it uses (the ViT, the projector, the newline
embedding), so the language model is never built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.anyres import AnyresLayout
from common.families import Family
from protocol.to_gateway import AnyresInfo
from vision_encoder.towers.tower import RunOptions, TowerImage, VisionTower

@dataclass(frozen=True)
class Preprocessed:
    pixel_values: torch.Tensor  # (n_images, most tiles, 3, tile, tile), padded, in the tower's dtype
    image_sizes: torch.Tensor  # (n_images, 2): (height, width) before the gateway downscaled
    ready: Any = None  # the preprocessing stream's event (CUDA), see DeviceIO


def layout_of(config: Any) -> AnyresLayout:
    ratio = getattr(config, "vision_aspect_ratio", None)  # OneVision's; LLaVA-NeXT does not shrink
    if ratio is not None and not ratio.startswith("anyres_max_"):
        raise ValueError(f"vision_aspect_ratio {ratio!r}: only anyres_max_N is served (vLLM's LLaVA-OneVision assumes it)")
    return AnyresLayout(
        tile_size=config.vision_config.image_size,
        patch_size=config.vision_config.patch_size,
        grid_pinpoints=tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints),
        max_tiles=None if ratio is None else int(ratio.removeprefix("anyres_max_")),
    )


class AnyresTower(VisionTower):
    def __init__(self, model_id: str, path: Path, config: Any, family: Family, dtype: str, device: str,
                 min_pixels: int | None = None, max_pixels: int | None = None, options: RunOptions = RunOptions()) -> None:
        from transformers import AutoImageProcessor

        self.refuse_pixel_budget(family, min_pixels, max_pixels, "tiles each image at the checkpoint's grid pinpoints")
        super().__init__(model_id, config, family, dtype, device, options)
        self.layout = layout_of(config)
        self.processor = AutoImageProcessor.from_pretrained(path)
        if [tuple(p) for p in self.processor.image_grid_pinpoints] != list(self.layout.grid_pinpoints):
            raise ValueError("the image processor's image_grid_pinpoints differ from config.json's: vLLM counts "
                             "tokens by the config and tiles by the processor, so the checkpoint is inconsistent")
        self.feature_layer = config.vision_feature_layer
        self.select_strategy = config.vision_feature_select_strategy
        self._load(path, config)

    def vision_weight(self, name: str) -> str | None:
        if not self.family.is_vision_weight(name):
            return None
        name = name.removeprefix("model.")
        # Published checkpoints (and vLLM) name the ViT's weights with a `vision_model.`
        # level that transformers 5's SigLIP and CLIP modules no longer have.
        return name.replace("vision_tower.vision_model.", "vision_tower.", 1)

    def _module(self, config: Any) -> torch.nn.Module:
        module, source = self._vision_code(config)
        from transformers import AutoModel

        class AnyresVision(torch.nn.Module):
            get_image_features = source.get_image_features
            pack_image_features = source.pack_image_features

            def __init__(self) -> None:
                super().__init__()
                self.config = config
                self.vision_tower = AutoModel.from_config(config.vision_config)
                # LlavaOnevisionModel's is LlavaOnevisionMultiModalProjector, LlavaNextModel's LlavaNextMultiModalProjector
                projector = getattr(module, source.__name__.removesuffix("Model") + "MultiModalProjector")
                self.multi_modal_projector = projector(config)
                self.image_newline = torch.nn.Parameter(torch.empty(config.text_config.hidden_size))

        return AnyresVision()

    @property
    def processor_info(self) -> AnyresInfo:
        layout = self.layout
        return AnyresInfo(layout.tile_size, layout.patch_size, layout.grid_pinpoints, layout.max_tiles)

    def family_params(self) -> dict:
        return {
            "image_grid_pinpoints": [list(x) for x in self.processor.image_grid_pinpoints],
            "do_pad": bool(self.processor.do_pad),
            "vision_feature_layer": self.feature_layer,
            "vision_feature_select_strategy": self.select_strategy,
            "max_tiles": self.layout.max_tiles,
        }

    def num_patches(self, height: int, width: int) -> int:
        pin_h, pin_w = self.layout.best_resolution(height, width)
        tiles = 1 + (pin_h // self.layout.tile_size) * (pin_w // self.layout.tile_size)
        return tiles * self.layout.tile_grid**2

    def preprocess(self, images: list[TowerImage]) -> Preprocessed:
        with self.io.preparing():
            # channels_last said, not guessed: a (3, w, 3) image would be read as channels first
            out = self.processor(images=[image.pixels for image in images], input_data_format="channels_last", return_tensors="pt",
                                 **self.processor_device)
            pixels = out["pixel_values"].to(self.dtype)
            ready = self.io.prepared()
        # The tiles come from the pixels as sent; the unpadding follows the original
        # aspect ratio, as vLLM's does on the raw image (the best pinpoint is the same).
        return Preprocessed(pixels, torch.tensor([image.original_size for image in images]), ready)

    @torch.inference_mode()
    def encode(self, batch: Preprocessed) -> list[tuple[torch.Tensor, None]]:
        shrink = {} if self.layout.max_tiles is None else {"vision_aspect_ratio": f"anyres_max_{self.layout.max_tiles}"}
        self.io.wait_for(batch.ready, [batch.pixel_values])
        out = self.model.get_image_features(
            self.io.to_device(batch.pixel_values), batch.image_sizes,
            vision_feature_layer=self.feature_layer, vision_feature_select_strategy=self.select_strategy, **shrink,
        )
        features = list(out.pooler_output)
        tokens = self.io.to_host(torch.cat(features))  # one copy down for the batch
        return [(t, None) for t in tokens.split([f.shape[0] for f in features])]
