"""An image's cache key carries the encoder's fingerprint: every image-processor
setting that changes the pixels the tower sees is in it."""

from __future__ import annotations

import json
import shutil

import pytest

from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from vision_encoder.towers import load_tower


@pytest.mark.parametrize("change", [{"do_normalize": False}, {"do_rescale": False}, {"do_convert_rgb": False},
                                    {"image_mean": [0.5, 0.5, 0.5]}])
def test_a_checkpoint_whose_processor_differs_only_there_keys_its_images_apart(tmp_path, change):
    base = load_tower(str(ensure_demo_model(RANDOM_MODEL)), "float32", "cpu").preprocessing_params()
    copy = tmp_path / "copy"
    shutil.copytree(RANDOM_MODEL, copy)
    config = json.loads((copy / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps({**config, **change}))
    assert load_tower(str(copy), "float32", "cpu").preprocessing_params() != base
