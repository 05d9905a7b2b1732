"""The tower builds its modules without drawing random weights (the checkpoint
overwrites every parameter; tower.py `_build`). What that must not change:
every tensor the module holds, buffers computed at construction included
(rotary frequencies, position ids), equals what transformers' own
initialisation followed by the same checkpoint gives. A transformers release
that moved a buffer's value into its weight initialisation would fail here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from tests.unit.test_packed_attention import FAMILIES, checkpoint
from vision_encoder.towers import load_tower
from common.checkpoint import weight_files


def initialised_then_loaded(tower, path) -> dict[str, torch.Tensor]:
    model = tower._module(AutoConfig.from_pretrained(path))
    model.load_state_dict(tower._vision_state(weight_files(path)), strict=False)
    model = model.to(tower.dtype)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_of_the_tower_is_the_checkpoint_s_or_computed_at_construction(family):
    path = Path(checkpoint(family))
    tower = load_tower(path, "float32", "cpu")
    built = {**dict(tower.model.named_parameters()), **dict(tower.model.named_buffers())}
    expected = initialised_then_loaded(tower, path)
    assert built.keys() == expected.keys()
    different = [name for name in built if not torch.equal(built[name], expected[name])]
    assert not different, f"{family}: {different[:5]}"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_vision_weights_an_engine_checks_are_those_the_encoder_loads(family):
    """The engine reads its checkpoint's vision weights by the family's rule (it loads no tower); the
    gateway compares its digest with the encoder's, so the weights each tower loads must be those,
    and its digest the same."""
    from safetensors import safe_open

    from common.checkpoint import vision_weights_digest

    path = Path(checkpoint(family))
    tower = load_tower(path, "float32", "cpu")
    names = [name for file in weight_files(path) for name in safe_open(str(file), framework="pt").keys()]
    by_tower = {name for name in names if tower.vision_weight(name) is not None}
    assert by_tower and by_tower == {name for name in names if tower.family.is_vision_weight(name)}
    assert tower.vision_weights == vision_weights_digest(path, tower.family)
