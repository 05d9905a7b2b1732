"""The visual tower alone: HF image processor + ViT + merger, no language model.

Only the checkpoint's vision weights are read from disk. Images of different
resolutions are packed into one forward pass: the Qwen towers take a flat
sequence of patches plus each image's (t, h, w) grid and attend within images.
The family (prism/families.py) names the tower's class and what its output
is: the merger's tokens, followed for Qwen3-VL by each DeepStack feature.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from cache import content_key
from prism.families import Family, family_of
from protocol.to_gateway import ProcessorInfo

# Key prefixes of the vision weights: transformers >= 4.52 saves `model.visual.`,
# the original Qwen2-VL / Qwen2.5-VL checkpoints use `visual.`.
_VISION_PREFIXES = ("model.visual.", "visual.")


def _vision_class(family: Family, model_type: str):
    module, _, name = family.towers[model_type].partition(":")
    return getattr(importlib.import_module(module), name)


def local_checkpoint(model: str) -> Path:
    """A checkpoint directory, or a hub id fetched (on machines with internet)."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))


def _weight_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"].values())
        return sorted(checkpoint / n for n in names)
    return sorted(checkpoint.glob("*.safetensors"))


def _load_vision_state(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
                if prefix:
                    state[name[len(prefix) :]] = f.get_tensor(name)
    if not state:
        raise ValueError(f"no vision weights (prefixes {_VISION_PREFIXES}) in {files}")
    return state


def _weights_digest(state: dict[str, torch.Tensor]) -> bytes:
    hasher = xxhash.xxh3_128()
    for name in sorted(state):
        hasher.update(name.encode())
        hasher.update(state[name].contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.digest()


@dataclass(frozen=True)
class Preprocessed:
    pixel_values: torch.Tensor  # (Σ patches, C·T·P·P)
    grid_thw: torch.Tensor  # (n_images, 3)


class VisionTower:
    def __init__(self, checkpoint: str, dtype: str, device: str, min_pixels=None, max_pixels=None):
        from transformers import AutoConfig, AutoImageProcessor

        path = local_checkpoint(checkpoint)
        config = AutoConfig.from_pretrained(path)
        self.family = family_of(config)  # an unsupported checkpoint stops here, naming why
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.model_id = str(checkpoint)
        self.merge_size = config.vision_config.spatial_merge_size
        self.embedding_width = self.family.embedding_width(config)
        overrides = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
        if overrides:
            # Qwen processors read both spellings; `size` is the one they resize by.
            overrides["size"] = {"shortest_edge": overrides.get("min_pixels"), "longest_edge": overrides.get("max_pixels")}
        self.processor = AutoImageProcessor.from_pretrained(path, **overrides)
        state = _load_vision_state(_weight_files(path))
        self.model = self._build(config, state)
        self.fingerprint = self._fingerprint(path, state)

    def _build(self, config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        cls = _vision_class(self.family, config.model_type)
        model = cls._from_config(config.vision_config, dtype=self.dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision weights mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model.to(self.device, self.dtype).eval()

    @property
    def processor_info(self) -> ProcessorInfo:
        size = self.processor.size
        return ProcessorInfo(
            patch_size=self.processor.patch_size,
            merge_size=self.processor.merge_size,
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
        )

    def preprocessing_params(self) -> dict:
        """Every processor parameter that changes the pixels the ViT sees."""
        p = self.processor
        return {
            "class": type(p).__name__,
            "size": dict(p.size),
            "patch_size": p.patch_size,
            "temporal_patch_size": p.temporal_patch_size,
            "merge_size": p.merge_size,
            "resample": int(p.resample),
            "rescale_factor": float(p.rescale_factor),
            "image_mean": list(map(float, p.image_mean)),
            "image_std": list(map(float, p.image_std)),
            "dtype": str(self.dtype),
        }

    def _fingerprint(self, path: Path, state: dict[str, torch.Tensor]) -> str:
        # Weights revision: the config and the vision weights' own bytes, so a
        # re-trained checkpoint of the same shapes gets new keys (file sizes
        # would not change). xxh3 reads a 7B model's 1.3 GB tower in ~0.2 s.
        config_bytes = (path / "config.json").read_bytes()
        return content_key(self.model_id, config_bytes, _weights_digest(state), self.preprocessing_params()).hex()

    def num_patches(self, height: int, width: int) -> int:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        info = self.processor_info
        h, w = smart_resize(height, width, info.patch_size * info.merge_size, info.min_pixels, info.max_pixels)
        return (h // info.patch_size) * (w // info.patch_size)

    def preprocess(self, images: list[np.ndarray]) -> Preprocessed:
        out = self.processor(images=images, return_tensors="pt")
        return Preprocessed(out["pixel_values"], out["image_grid_thw"])

    @torch.inference_mode()
    def encode(self, batch: Preprocessed) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """One packed forward; each image's (tokens, hidden) embeddings and grid."""
        pixels = batch.pixel_values.to(self.device, self.dtype)
        out = self.model(pixels, grid_thw=batch.grid_thw.to(self.device))
        # Qwen3-VL: each DeepStack layer's feature beside the merger's tokens, as vLLM takes them
        merged = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1) if self.family.deepstack else out.pooler_output
        grids = [tuple(int(x) for x in row) for row in batch.grid_thw.tolist()]
        sizes = [t * h * w // self.merge_size**2 for t, h, w in grids]
        return [(t.to("cpu").contiguous(), g) for t, g in zip(merged.split(sizes), grids)]
