"""InternVL's tiled image layout, in plain arithmetic (the gateway imports
it; no torch).

The image processor (transformers' GotOcr2ImageProcessor) picks the grid of
square tiles, between `min_tiles` and `max_tiles` of them, whose aspect
ratio is closest to the image's (on a tie, the grid with more tiles while
the image covers more than half of it), stretches the image onto that
canvas and cuts it; when that makes more than one tile, a thumbnail of the
whole image follows. Each tile becomes `tokens_per_tile` tokens. The count
is the processor's `get_number_of_image_patches` (which vLLM uses) times
that; a unit test pins both to vLLM and to the features themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=8)
def _grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(columns, rows) of every allowed grid, fewest tiles first (transformers' order)."""
    grids = [(cols, rows) for cols in range(1, max_tiles + 1) for rows in range(1, max_tiles + 1)
             if min_tiles <= cols * rows <= max_tiles]
    return sorted(grids, key=lambda grid: grid[0] * grid[1])


@dataclass(frozen=True)
class TileLayout:
    tile_size: int  # square tiles, the ViT's input side
    min_tiles: int
    max_tiles: int
    crop: bool  # False: the whole image is one tile, whatever its size
    tokens_per_tile: int

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `get_optimal_tiled_canvas`: (columns, rows)."""
        aspect, area = width / height, width * height
        best, best_diff = (1, 1), math.inf
        for cols, rows in _grids(self.min_tiles, self.max_tiles):
            diff = abs(aspect - cols / rows)
            if diff < best_diff:
                best, best_diff = (cols, rows), diff
            elif diff == best_diff and area > 0.5 * self.tile_size**2 * cols * rows:
                best = (cols, rows)
        return best

    def tiles(self, height: int, width: int) -> int:
        """The crops, plus the thumbnail when there are several; 1 without cropping."""
        if not self.crop or self.max_tiles <= 1:
            return 1
        cols, rows = self.grid(height, width)
        return 1 + cols * rows if cols * rows > 1 else 1

    def sent_size(self, height: int, width: int) -> tuple[int, int]:
        """The smallest same-shaped image that still covers the canvas it is
        stretched onto (no detail lost); never larger than the original."""
        cols, rows = self.grid(height, width) if self.crop and self.max_tiles > 1 else (1, 1)
        scale = max(cols * self.tile_size / width, rows * self.tile_size / height)
        if scale >= 1:
            return height, width
        return min(height, math.ceil(height * scale)), min(width, math.ceil(width * scale))

    def visual_tokens(self, height: int, width: int) -> int:
        return self.tiles(height, width) * self.tokens_per_tile
