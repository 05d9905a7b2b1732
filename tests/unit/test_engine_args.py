"""The engine config reaches vLLM's engine args as written (GPU knobs included), and the
environment the engine service prepares for vLLM."""

from __future__ import annotations

import os

import pytest

from llm_engine.config import EngineConfig
from llm_engine.service import engine_args, sample_without_unbuildable_kernels
from common.families import FAMILIES

QWEN2_VL, QWEN3_VL = FAMILIES[0], FAMILIES[2]
SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"


def test_vllm_knobs_pass_through():
    config = EngineConfig(
        model="/models/qwen", max_num_batched_tokens=8192, kv_cache_memory_mb=None, gpu_memory_utilization=0.85,
        kv_cache_dtype="fp8", enable_chunked_prefill=True, enforce_eager=False, tensor_parallel_size=2,
        kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    )
    args = engine_args(config, QWEN2_VL)
    assert (args.max_num_batched_tokens, args.kv_cache_memory_bytes, args.gpu_memory_utilization) == (8192, None, 0.85)
    assert (args.kv_cache_dtype, args.enable_chunked_prefill, args.enforce_eager, args.tensor_parallel_size) == ("fp8", True, False, 2)
    assert args.kv_transfer_config.kv_connector == "NixlConnector" and args.kv_transfer_config.kv_role == "kv_both"
    # images arrive as embeddings: the vision tower is never loaded
    assert args.enable_mm_embeds and args.limit_mm_per_prompt == {"image": 0, "video": 0}


def test_defaults_leave_vllm_its_own_choices():
    args = engine_args(EngineConfig(model="/models/demo"), QWEN2_VL)
    assert args.kv_transfer_config is None and args.enable_chunked_prefill is None and args.kv_cache_dtype == "auto"
    assert args.kv_cache_memory_bytes == 1024 * 2**20


def test_a_deepstack_family_keeps_the_tower_in_vllm_unprofiled():
    args = engine_args(EngineConfig(model="/models/qwen3", max_images_per_prompt=6), QWEN3_VL)
    assert args.enable_mm_embeds and args.limit_mm_per_prompt == {"image": 6, "video": 0} and args.skip_mm_profiling


@pytest.mark.parametrize("flashinfer_usable, deployment_set, expected", [
    (False, None, "0"),  # FlashInfer's kernels can be neither loaded nor built: vLLM's own sampler
    (True, None, None),  # they can: vLLM's default stands
    (False, "1", "1"),  # the deployment's choice stands
])
def test_the_sampler_avoids_flashinfer_only_where_its_kernels_cannot_be_had(monkeypatch, flashinfer_usable, deployment_set,
                                                                            expected):
    import vllm.utils.flashinfer

    monkeypatch.setattr(vllm.utils.flashinfer, "has_flashinfer", lambda: flashinfer_usable)
    monkeypatch.setenv(SAMPLER_ENV, "")  # records what was there: restored at teardown, whatever the call sets
    if deployment_set is None:
        monkeypatch.delenv(SAMPLER_ENV)
    else:
        monkeypatch.setenv(SAMPLER_ENV, deployment_set)
    sample_without_unbuildable_kernels()
    assert os.environ.get(SAMPLER_ENV) == expected
