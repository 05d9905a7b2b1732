"""The tower for a checkpoint, by its family's layout (common/families.py)."""

from __future__ import annotations

from common.families import UnsupportedModel, family_of
from vision_encoder.towers.anyres_tower import AnyresTower
from vision_encoder.towers.qwen_tower import QwenTower
from vision_encoder.towers.tiles_tower import TilesTower
from vision_encoder.towers.tower import RunOptions, VisionTower, local_checkpoint

TOWERS = {"qwen": QwenTower, "anyres": AnyresTower, "tiles": TilesTower}


def load_tower(checkpoint: str, dtype: str, device: str, min_pixels: int | None = None,
               max_pixels: int | None = None, options: RunOptions = RunOptions()) -> VisionTower:
    from transformers import AutoConfig

    path = local_checkpoint(checkpoint)
    config = AutoConfig.from_pretrained(path)
    family = family_of(config)  # an unsupported checkpoint stops here, naming why
    if not family.takes_images:
        raise UnsupportedModel(f"{checkpoint} is a text-only model ({(config.architectures or [config.model_type])[0]}): it has "
                               "no vision tower for an encoder to run; serve it with no encoder (gateway.encoder_addresses: [])")
    return TOWERS[family.layout](str(checkpoint), path, config, family, dtype, device, min_pixels, max_pixels, options)
