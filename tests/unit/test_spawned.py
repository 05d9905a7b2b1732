"""The embedding-length fix reaches the processes vLLM spawns: there, once vLLM
imports LLaVA-OneVision's, LLaVA-NeXT's and InternVL's model modules, their embedding
schemas accept images of different lengths in one batch (without it a second
concurrent user of another image size killed vLLM's engine core)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from llm_engine.spawned import customize_spawned_vllm_processes


def _schemas_accept_mixed_lengths() -> list[str]:
    from vllm.model_executor.models.interns1 import InternS1ImageEmbeddingInputs
    from vllm.model_executor.models.llava_next import LlavaNextImageEmbeddingInputs
    from vllm.model_executor.models.llava_onevision import LlavaOnevisionImageEmbeddingInputs

    accepted = []
    for schema in (LlavaOnevisionImageEmbeddingInputs, LlavaNextImageEmbeddingInputs, InternS1ImageEmbeddingInputs):
        schema(type="image_embeds", data=[torch.zeros(7, 8), torch.zeros(3, 8)])  # raises if not
        accepted.append(schema.__name__)
    return accepted


def test_spawned_vllm_processes_take_embeddings_of_different_lengths_in_one_batch(monkeypatch):
    """In the processes started the way vLLM starts them (`get_mp_context`): on a GPU host vLLM would
    fork them by default, and a fork of this process has no fix."""
    from vllm.utils.system_utils import get_mp_context

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # both restored after the test
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    customize_spawned_vllm_processes(0)
    with get_mp_context().Pool(1) as pool:
        assert pool.apply(_schemas_accept_mixed_lengths) == ["LlavaOnevisionImageEmbeddingInputs", "LlavaNextImageEmbeddingInputs", "InternS1ImageEmbeddingInputs"]


def test_without_it_vllm_refuses_them():
    """What the fix is for, in a process without it: the check vLLM's worker runs."""
    with multiprocessing.get_context("spawn").Pool(1) as pool, pytest.raises(ValueError, match="inconsistent shapes"):
        pool.apply(_schemas_accept_mixed_lengths)
