"""LLaVA-OneVision's and LLaVA-NeXT's "anyres" image layout, in plain
arithmetic (the gateway imports it; no torch).

The processor picks the grid pinpoint (a multiple of the tile size) that
keeps the most of the image while wasting the least, scales the image to fit
inside it, pads it and cuts it into tiles; a base tile of the whole image,
squashed, comes first. After the ViT, the tiles' features are stitched into
one map, the padding is cut away again (`unpad`), a map larger than
`max_tiles` tiles is shrunk back to about that area, and one newline token
ends each row. The visual-token count below is vLLM's
(`LlavaOnevisionProcessingInfo.get_num_image_tokens`), restated; a unit test
pins it to vLLM's function and to the length of the features themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AnyresLayout:
    tile_size: int  # the ViT's input side (vision_config.image_size)
    patch_size: int
    grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width), each a multiple of tile_size
    # OneVision's "anyres_max_9" → 9: a larger feature map is shrunk to about this
    # many tiles; None (LLaVA-NeXT): never shrunk.
    max_tiles: int | None

    @property
    def tile_grid(self) -> int:
        """Features per tile along each side."""
        return self.tile_size // self.patch_size

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `select_best_resolution`: most effective pixels, then least waste."""
        best, most, least_waste = self.grid_pinpoints[0], 0, math.inf
        for pin_h, pin_w in self.grid_pinpoints:
            scale = min(pin_w / width, pin_h / height)
            effective = min(int(width * scale) * int(height * scale), width * height)
            waste = pin_w * pin_h - effective
            if effective > most or (effective == most and waste < least_waste):
                best, most, least_waste = (pin_h, pin_w), effective, waste
        return best

    def fitted_size(self, height: int, width: int) -> tuple[int, int]:
        """The size the processor scales the image to inside its best pinpoint
        (`get_patch_output_size`): the tiles hold no more detail than this."""
        target_h, target_w = self.best_resolution(height, width)
        scale_w, scale_h = target_w / width, target_h / height
        if scale_w < scale_h:
            return min(math.ceil(height * scale_w), target_h), target_w
        return target_h, min(math.ceil(width * scale_h), target_w)

    def sent_size(self, height: int, width: int) -> tuple[int, int]:
        """What the gateway sends: no larger than the tiles hold it, never enlarged
        (the encoder unpads by the original size, which travels beside it)."""
        fitted = self.fitted_size(height, width)
        return fitted if fitted[0] * fitted[1] < height * width else (height, width)

    def visual_tokens(self, height: int, width: int) -> int:
        grid = self.tile_grid
        pin_h, pin_w = self.best_resolution(height, width)
        rows, cols = grid * (pin_h // self.tile_size), grid * (pin_w // self.tile_size)
        if width / height > cols / rows:  # wider than the tiles: padding above and below
            kept = int(round(height * (cols / width), 7))
            rows -= 2 * ((rows - kept) // 2)
        else:
            kept = int(round(width * (rows / height), 7))
            cols -= 2 * ((cols - kept) // 2)
        if self.max_tiles is not None:
            ratio = math.sqrt(rows * cols / (self.max_tiles * grid**2))
            if ratio > 1.1:
                rows, cols = int(rows // ratio), int(cols // ratio)
        return grid * grid + rows * cols + rows  # base tile, the unpadded map, one newline per row
