"""Each family's tower as the encoder runs it, against transformers' eager
path: Qwen's towers with their plan precomputed and attention in one packed
call per layer (vision_encoder/towers/attention.py, qwen_tower.plan_of), and padded
to a CUDA graph's bucket (vision_encoder/towers/graphs.py); SigLIP's and
InternViT's through transformers' own SDPA. On the CPU the packed call is the
padded one; varlen and flash are CUDA kernels (bench.gpu_encoder checks them
against this same path there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from prism.tiny_models import ensure_tiny_model
from vision_encoder.towers import attention
from vision_encoder.towers.graphs import Padding, buckets_up_to
from vision_encoder.towers.tower import RunOptions, TowerImage
from vision_encoder.towers import load_tower

QWEN = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]
FAMILIES = [*QWEN, "llava-onevision", "llava-next", "internvl3"]
# sizes that give several windows per image, a strip one window high, and unequal images in one batch
SIZES = [(224, 224), (300, 500), (600, 412), (56, 900)]


def checkpoint(family: str) -> str:
    return str(ensure_demo_model(RANDOM_MODEL) if family == "qwen2-vl" else ensure_tiny_model(family))


def images(seed: int = 0) -> list[TowerImage]:
    rng = np.random.default_rng(seed)
    return [TowerImage(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), (h, w)) for h, w in SIZES]


def eager_reference(tower, batch) -> list[torch.Tensor]:
    """The same tower's tokens by transformers' eager attention; Qwen's forward
    given only the grids, deriving everything else itself."""
    for module in tower.model.modules():  # the ViT may hold a config object of its own
        if hasattr(getattr(module, "config", None), "_attn_implementation"):
            module.config._attn_implementation = "eager"
    if not hasattr(batch, "plan"):
        return [tokens for tokens, _ in tower.encode(batch)]
    with torch.inference_mode():
        out = tower.model(batch.pixel_values, grid_thw=batch.grid_thw)
    tokens = torch.cat([out.pooler_output, *out.deepstack_features], -1) if tower.family.deepstack else out.pooler_output
    return list(tokens.split([int(g.prod()) // tower.merge_size**2 for g in batch.grid_thw]))


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = torch.cat([t.float().reshape(-1) for t in a]), torch.cat([t.float().reshape(-1) for t in b])
    return float((x - y).norm() / y.norm())


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_encoder_s_tower_gives_transformers_eager_tokens(family, dtype, tolerance):
    options = RunOptions(attention="padded") if family in QWEN else RunOptions()
    tower = load_tower(checkpoint(family), dtype, "cpu", options=options)
    batch = tower.preprocess(images())
    got = [tokens for tokens, _ in tower.encode(batch)]
    expected = eager_reference(tower, batch)
    assert [t.shape for t in got] == [t.shape for t in expected]
    assert relative(got, expected) < tolerance


@pytest.mark.parametrize("family", QWEN)
def test_the_loop_and_the_packed_call_agree(family):
    loop = load_tower(checkpoint(family), "float32", "cpu", options=RunOptions(attention="loop"))
    packed = load_tower(checkpoint(family), "float32", "cpu", options=RunOptions(attention="padded"))
    assert (loop.attention, packed.attention) == ("loop", "padded")
    batch = packed.preprocess(images(1))
    a = [t for t, _ in loop.encode(batch)]
    b = [t for t, _ in packed.encode(batch)]
    assert relative(a, b) < 1e-5


@pytest.mark.parametrize("family", QWEN)
def test_a_batch_padded_to_a_graph_bucket_keeps_its_tokens(family):
    tower = load_tower(checkpoint(family), "float32", "cpu", options=RunOptions(attention="padded"))
    info = tower.processor_info
    padding = Padding(tuple(buckets_up_to(16384)), tower.merge_size**2, info.max_pixels // info.patch_size**2,
                      window=64 if getattr(tower.model, "window_size", None) else None, max_images=16)
    batch = tower.preprocess(images(2))
    bucket, pixels, plan = padding.pad(batch.pixel_values, batch.plan)
    assert bucket > batch.patches and pixels.shape[0] == bucket
    with torch.inference_mode():
        padded = tower._forward(pixels, plan)[: batch.patches // tower.merge_size**2]
    unpadded = torch.cat([t for t, _ in tower.encode(batch)])
    assert relative([padded], [unpadded]) < 1e-5


def test_window_bounds_fit_the_graph_s_fixed_length_for_any_image_shape():
    from transformers.vision_utils import get_vision_window_index

    padding = Padding((4096,), merge_unit=4, longest_image=4096, window=64, max_images=16)
    rng = np.random.default_rng(0)
    shapes = [(1, 1), (1, 512), (512, 1), (2, 2), (3, 5)] + [tuple(rng.integers(1, 40, 2)) for _ in range(200)]
    for units_h, units_w in shapes:  # in merge units (2 × 2 patches)
        grids = torch.tensor([[1, 2 * units_h, 2 * units_w]] * min(16, 1024 // (units_h * units_w) or 1))
        if int(grids.prod(dim=1).sum()) > 4096:
            grids = grids[:1]
        _, cu_windows = get_vision_window_index(grids, 2, 112, 14)
        assert cu_windows.numel() <= padding.capacity("cu_window_seqlens", 4096) - 4096 // 64 - 1


def test_buckets_grow_by_root_two_and_cover_the_largest():
    sizes = buckets_up_to(16384)
    assert sizes[0] == 1024 and sizes[-1] >= 16384 and all(s % 64 == 0 for s in sizes)
    assert all(1.3 < b / a < 1.5 for a, b in zip(sizes, sizes[1:]))
    assert sizes[::2] == [1024, 2048, 4096, 8192, 16384]  # a 32 × 256² batch (32,768 patches) fills its bucket


def test_auto_attention_is_the_loop_on_a_cpu_and_a_cuda_kernel_by_name_is_refused_there():
    cpu = torch.device("cpu")
    assert attention.choose("auto", cpu) == "loop"
    assert attention.choose("padded", cpu) == "padded"
    for backend in ("varlen", "flash"):
        with pytest.raises(ValueError, match="encoder.attention"):
            attention.choose(backend, cpu)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_compiled_blocks_give_the_same_tokens(family):
    """encoder.compile_blocks: every block compiled (vision_encoder/towers/tower.py), the tokens unchanged,
    over two batches of different shapes (the second recompiles with dynamic shapes). Qwen3-VL's
    tokens carry its DeepStack features, merged from compiled blocks' outputs."""
    eager = load_tower(checkpoint(family), "float32", "cpu", options=RunOptions(attention="padded"))
    compiled = load_tower(checkpoint(family), "float32", "cpu", options=RunOptions(attention="padded", compile_blocks=True))
    assert all(hasattr(block, "_compiled_call_impl") and block._compiled_call_impl for block in compiled.model.blocks)
    for seed, count in ((0, 2), (1, 4)):
        batch = eager.preprocess(images(seed)[:count])
        expected = [t for t, _ in eager.encode(batch)]
        got = [t for t, _ in compiled.encode(batch)]
        assert relative(got, expected) < 1e-4


def test_the_packed_kernels_are_not_chosen_on_a_gpu_older_than_ampere(monkeypatch):
    """FlashAttention's kernels (flash_attn's, and the one torch's varlen calls) refuse older GPUs:
    `auto` takes the padded call there, as on a GPU without either."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    turing = torch.device("cuda")
    assert attention.choose("auto", turing) == "padded"
    with pytest.raises(ValueError, match="older than Ampere"):
        attention.choose("varlen", turing)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention.choose("auto", turing) in ("flash", "varlen")


def test_a_float32_tower_on_a_gpu_takes_the_padded_call(monkeypatch):
    """The FlashAttention kernels run fp16 and bf16 only (encoder.dtype float32 is the parity runs')."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hopper = torch.device("cuda")
    assert attention.choose("auto", hopper, torch.float32) == "padded"
    with pytest.raises(ValueError, match="half precision only"):
        attention.choose("varlen", hopper, torch.float32)
