"""The vision half of a checkpoint, alone: image processor, ViT and projector,
no language model. Only the checkpoint's vision weights are read from disk.

This module holds what every family's tower shares: finding the checkpoint,
reading its vision weights, and the fingerprint that goes into every cache
key. The families' own towers (qwen_tower.py, anyres_tower.py) say how
images are preprocessed, run and measured; towers.py picks one by family.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cache import content_key, library_versions
from common.checkpoint import vision_weights_digest, weight_files
from common.families import Family
from vision_encoder.towers.device_io import DeviceIO
from vision_encoder.towers.patch_matmul import patch_convs_as_matmul


# Raised when the tower computes other tokens from the same weights and pixels (a fix of
# its arithmetic): keys made before, in a shared cache, then miss instead of serving those.
# 2: the rotary frequencies kept in float32 under a bf16 tower.
NUMERICS_REVISION = 2


@dataclass(frozen=True)
class RunOptions:
    """How a tower runs on its device (EncoderConfig's keys of the same names)."""

    attention: str = "auto"  # vision_encoder/towers/attention.py
    preprocess_on_device: bool = True  # the image processor on the tower's GPU (no effect on a CPU)
    graph_max_patches: int = 0  # CUDA graphs for batches up to this many patches (0: none; vision_encoder/towers/graphs.py)
    max_batch_images: int = 16  # the most images a batch holds (sizes the graphs' inputs)
    compile_blocks: bool = False  # torch.compile each ViT block (compile_blocks below)


@dataclass(frozen=True)
class TowerImage:
    pixels: np.ndarray  # uint8 (h, w, 3), as the gateway sent it
    original_size: tuple[int, int]  # (height, width) before the gateway downscaled it
    sized: bool = False  # the gateway says the pixels are at their final size (ImageInput.sized)


def local_checkpoint(model: str) -> Path:
    """A checkpoint directory, or a hub id fetched (on machines with internet)."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each block of the ViT (the model's longest ModuleList: Qwen's
    `blocks`, SigLIP's and InternViT's encoder layers); how many. Eager, a block
    is some twenty kernels of which the matrix products are half the time and
    the rest norms, rotary and activations, each a pass over memory; compiled,
    those fuse. Shapes change with every batch: torch recompiles once with
    dynamic shapes after the first, and then no more."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    blocks = max(lists, key=len, default=[])
    for block in blocks:
        block.compile()
    return len(blocks)


class VisionTower:
    """A family's tower sets `processor` and then calls `_load`; it implements
    the methods below that raise NotImplementedError."""

    processor: Any

    def __init__(self, model_id: str, config: Any, family: Family, dtype: str, device: str,
                 options: RunOptions = RunOptions()) -> None:
        self.model_id = model_id
        self.family = family
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.options = options
        self.io = DeviceIO(self.device)
        self.embedding_width = family.embedding_width(config)

    @property
    def processor_device(self) -> dict:
        """The image processor's `device` argument: the tower's GPU when preprocessing runs there."""
        return {"device": self.device} if self.io.cuda and self.options.preprocess_on_device else {}

    def _vision_code(self, config: Any) -> tuple[Any, type]:
        """The transformers module and class that hold the family's vision code (common/families.py)."""
        module, _, name = self.family.towers[config.model_type].partition(":")
        source = importlib.import_module(module)
        return source, getattr(source, name)

    @staticmethod
    def refuse_pixel_budget(family: Family, min_pixels: int | None, max_pixels: int | None, sizing: str) -> None:
        """`encoder.min_pixels` / `max_pixels` are Qwen's; a family that sizes images otherwise stops at start-up."""
        if min_pixels or max_pixels:
            raise ValueError(f"encoder.min_pixels / encoder.max_pixels set a Qwen pixel budget; {family.name} "
                             f"{sizing} instead: leave them unset")

    def _load(self, path: Path, config: Any) -> None:
        state = self._vision_state(weight_files(path))
        self.model = self._build(config, state)
        # Weights revision: the config and the vision weights' own bytes, so a
        # re-trained checkpoint of the same shapes gets new keys (file sizes
        # would not change). Read once at start-up; xxh3 keeps that a small part of
        # loading the weights (its bytes are the checkpoint's, not a client's: cache/keys.py).
        # Not the checkpoint's path: replicas that mount one checkpoint at different
        # paths are the same encoder, for the gateway's check and for a shared cache.
        config_bytes = (path / "config.json").read_bytes()
        self.vision_weights = vision_weights_digest(path, self.family)  # the engine's must be the same (handshakes)
        self.fingerprint = content_key(config_bytes, self.vision_weights, self.preprocessing_params()).hex()

    def _vision_state(self, files: list[Path]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        state: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if (local := self.vision_weight(name)) is not None:
                        state[local] = f.get_tensor(name)
        if not state:
            raise ValueError(f"no {self.family.name} vision weights in {files}")
        return state

    def _build(self, config: Any, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        from transformers.initialization import no_init_weights

        # Every parameter is overwritten by the checkpoint's (a missing one stops
        # below), so drawing random values for them first is wasted start-up.
        with no_init_weights():
            model = self._module(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision weights mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model = _to_device(model, self.device, self.dtype).eval()
        patch_convs_as_matmul(model, self.device)  # as vLLM's towers run them (patch_matmul.py)
        if self.options.compile_blocks:
            compile_blocks(model)
        return model

    @functools.cached_property
    def key_fingerprint(self) -> str:
        """The fingerprint in its cache keys: the handshake's, and what else makes this replica's
        tokens its own: the code that preprocesses and encodes, and how it runs the ViT
        (`arithmetic_params`). Not in the handshake's: replicas of two releases serve side by
        side in a rolling upgrade, each with keys of its own. Read once the tower is built."""
        versions = library_versions("torch", "torchvision", "transformers")
        return content_key(self.fingerprint, versions, self.arithmetic_params()).hex()

    def arithmetic_params(self) -> dict:
        """How this replica runs the ViT, where that rounds otherwise (other kernels, fused
        blocks, another GPU): the same pixels then give tokens a few bf16 steps apart, and a
        shared cache tier must not serve one replica's as another's."""
        return {"compile_blocks": self.options.compile_blocks,
                "gpu": torch.cuda.get_device_name(self.device) if self.io.cuda else None}

    def device_lost(self) -> bool:
        """After a device error: whether the device still runs anything. A sticky error (an illegal
        address, a device-side assert, a GPU gone) fails every later call in this process; another
        (a launch's configuration, pinned host memory short) failed its own call only. The probe
        runs on a stream of its own and waits for that alone: not for another lane's batch."""
        if not self.io.cuda:
            return False
        try:
            with torch.cuda.stream(torch.cuda.Stream(self.device)):
                torch.ones(1, device=self.device).add_(1).cpu()
        except torch.OutOfMemoryError:  # short of memory, as a batch may be: the device still runs
            return False
        except Exception:  # noqa: BLE001 - any other error here is the device's
            return True
        return False

    def release_memory(self) -> None:
        """Hand the allocator's cached device memory back (after an out-of-memory error)."""
        if self.io.cuda:
            torch.cuda.empty_cache()

    def vision_weight(self, name: str) -> str | None:
        """The tower module's name for a checkpoint weight, or None if it is not a vision weight."""
        raise NotImplementedError

    def _module(self, config: Any) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def processor_info(self):
        """What the gateway needs to size images and count their tokens (the handshake)."""
        raise NotImplementedError

    def preprocessing_params(self) -> dict:
        """Every processor parameter that changes the pixels the ViT sees."""
        p = self.processor
        return {
            "class": type(p).__name__,
            "size": dict(p.size),
            "resample": int(p.resample),
            "rescale_factor": float(p.rescale_factor),
            "image_mean": list(map(float, p.image_mean)),
            "image_std": list(map(float, p.image_std)),
            # LLaVA-NeXT's processor crops each tile to its centre (the others have no crop).
            "crop_size": None if getattr(p, "crop_size", None) is None else dict(p.crop_size),
            # A switch that is off skips its step whatever the values above say.
            **{switch: getattr(p, switch, None)
               for switch in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_center_crop")},
            "dtype": str(self.dtype),
            "numerics": NUMERICS_REVISION,
            # torchvision resizes uint8 on a GPU through float32, on a CPU with its own uint8
            # kernel: up to a few grey levels apart; and a GPU's kernels round otherwise than a
            # CPU's: tokens made on either are not the other's
            "preprocessed_on": "cuda" if self.processor_device else "cpu",
            "vit_on": self.device.type,
            **self.family_params(),
        }

    def family_params(self) -> dict:
        """The family's own parameters beside the common ones above."""
        raise NotImplementedError

    def num_patches(self, height: int, width: int) -> int:
        """The ViT's work for an image of this size, in patches (batching and the stall bound)."""
        raise NotImplementedError

    def patches_of(self, image: TowerImage) -> int:
        """`num_patches` of the image as the gateway sent it (a family may size a resized one otherwise)."""
        return self.num_patches(*image.pixels.shape[:2])

    def preprocess(self, images: list[TowerImage]) -> Any:
        """The processor's output, pixels already cast to the tower's dtype: the
        cast runs here on the preprocessing thread, not on the ViT's (the
        bottleneck thread on a CPU)."""
        raise NotImplementedError

    def encode(self, batch: Any) -> list[tuple[torch.Tensor, tuple[int, int, int] | None]]:
        """One forward; each image's (tokens, width) embeddings and its grid, if the family has one."""
        raise NotImplementedError


class OutOfMemoryAbove:
    """Test hook (encoder.test_oom_above_rows): the tower, except that a batch of
    more than `rows` rows of pixel values (Qwen: patches; tiled families:
    tiles) raises the out-of-memory error a GPU would."""

    def __init__(self, tower: VisionTower, rows: int) -> None:
        self._tower = tower
        self._rows = rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tower, name)

    def encode(self, batch: Any) -> list:
        if batch.pixel_values.shape[0] > self._rows:
            raise torch.OutOfMemoryError(f"test hook: a batch of {batch.pixel_values.shape[0]} rows, over {self._rows}")
        return self._tower.encode(batch)


def _to_device(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The parameters in `dtype`, the floating-point buffers in the dtype the module made them in,
    as transformers' from_pretrained and vLLM keep them: the Qwen towers' rotary frequencies are
    float32, and rounded to bf16 the angle of a patch drifts in proportion to its row or column
    (docs/measurements/towers.md)."""
    made = {name: buffer for name, buffer in model.named_buffers() if buffer.is_floating_point()}
    model = model.to(device, dtype)
    for name, buffer in made.items():
        owner, _, attribute = name.rpartition(".")
        model.get_submodule(owner)._buffers[attribute] = buffer.to(device)
    return model
