"""The identity of a checkpoint's vision weights (common/checkpoint.py), which an encoder and an
engine report in their handshakes for the gateway to compare: the same for a directory and for a
hub id's snapshot in the local cache (the GPU configs name hub ids), another for another
checkpoint, none for a text-only model."""

from __future__ import annotations

import shutil

import huggingface_hub.constants
from transformers import AutoConfig

from common.checkpoint import model_vision_weights, vision_weights_digest
from common.families import family_of
from prism.tiny_models import ensure_tiny_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def test_a_hub_id_is_read_from_the_local_cache_as_its_directory_is(tmp_path, monkeypatch):
    path = ensure_tiny_model("qwen2.5-vl")
    family = family_of(AutoConfig.from_pretrained(path))
    repo = tmp_path / "models--prism--tiny-vl"
    shutil.copytree(path, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_vision_weights("prism/tiny-vl", family) == vision_weights_digest(path, family) != ""
    assert model_vision_weights("prism/not-downloaded", family) == ""  # not judged, and said so in the log


def test_other_checkpoints_differ_and_a_text_only_one_has_none():
    digests = {}
    for name in ("qwen2.5-vl", "qwen3-vl", "llava-onevision", "internvl3", "qwen2-text"):
        path = ensure_tiny_model(name)
        digests[name] = model_vision_weights(str(path), family_of(AutoConfig.from_pretrained(path)))
    assert digests.pop("qwen2-text") == ""
    assert len(set(digests.values())) == len(digests)
