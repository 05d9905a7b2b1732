"""An image's cache key carries the encoder's fingerprint: every image-processor
setting that changes the pixels the tower sees is in it."""

from __future__ import annotations

import json
import shutil

import pytest

from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.tiny_models import ensure_tiny_model
from vision_encoder.towers import load_tower


@pytest.mark.parametrize("family,change", [
    ("qwen2-vl", {"do_normalize": False}), ("qwen2-vl", {"do_rescale": False}), ("qwen2-vl", {"do_convert_rgb": False}),
    ("qwen2-vl", {"image_mean": [0.5, 0.5, 0.5]}),
    ("llava-next", {"do_center_crop": False}), ("llava-next", {"crop_size": {"height": 40, "width": 40}}),
])
def test_a_checkpoint_whose_processor_differs_only_there_keys_its_images_apart(tmp_path, family, change):
    original = ensure_demo_model(RANDOM_MODEL) if family == "qwen2-vl" else ensure_tiny_model(family)
    base = load_tower(str(original), "float32", "cpu").preprocessing_params()
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    if (path := copy / "preprocessor_config.json").exists():
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    else:  # transformers 5 keeps the image processor's settings inside the processor's
        path = copy / "processor_config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "image_processor": {**config["image_processor"], **change}}))
    assert load_tower(str(copy), "float32", "cpu").preprocessing_params() != base


def test_one_checkpoint_at_two_paths_is_one_encoder(tmp_path):
    """Replicas mount a checkpoint where they do: the gateway requires their fingerprints equal,
    and a shared cache tier is keyed by them."""
    copy = tmp_path / "elsewhere"
    shutil.copytree(ensure_demo_model(RANDOM_MODEL), copy)
    assert load_tower(str(copy), "float32", "cpu").fingerprint == load_tower(str(RANDOM_MODEL), "float32", "cpu").fingerprint


def test_a_key_changes_with_the_libraries_that_decode_resize_and_encode(monkeypatch):
    """An upgrade may round otherwise: its keys must not be the last release's in a shared tier
    (the encoder's keys: torch, torchvision, transformers; the gateway's part: Pillow, torch)."""
    import torch

    import cache.keys
    from gateway.intake.images import IntakePolicy, PixelBudget
    from protocol.to_gateway import ProcessorInfo

    def keys() -> tuple[str, dict]:
        cache.keys.library_versions.cache_clear()
        policy = IntakePolicy(ProcessorInfo(14, 2, 3136, 12845056), None)
        tower = load_tower(str(ensure_demo_model(RANDOM_MODEL)), "float32", "cpu")
        return tower.fingerprint, tower.key_fingerprint, policy.key_part(PixelBudget(3136, 12845056))

    try:
        before = keys()
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".post1")
        after = keys()
    finally:
        monkeypatch.undo()
        cache.keys.library_versions.cache_clear()
    # the keys move; the handshake's fingerprint does not (replicas of two releases serve side by side)
    assert before[0] == after[0] and before[1] != after[1] and before[2] != after[2]


@pytest.mark.parametrize("change", [{"attention": "padded"}, {"compile_blocks": True}])
def test_a_replica_that_runs_the_vit_otherwise_keys_its_images_apart_and_is_the_same_encoder(change):
    """Another attention kernel or fused blocks round otherwise: one replica's tokens must not be
    served as another's from a shared cache tier, yet the gateway takes both as one encoder."""
    from vision_encoder.towers.tower import RunOptions

    checkpoint = str(ensure_demo_model(RANDOM_MODEL))
    default, other = (load_tower(checkpoint, "float32", "cpu", options=options) for options in (RunOptions(), RunOptions(**change)))
    assert default.fingerprint == other.fingerprint
    assert default.key_fingerprint != other.key_fingerprint
