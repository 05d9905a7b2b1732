"""Which vision tower the encoder should run: transformers' (what it runs) or
vLLM's own, side by side in one process on the same weights and inputs.

Both towers are Qwen2.5-VL's at Qwen2.5-VL-7B's widths (1280 wide, 16 heads,
windowed attention with a full-attention block; `--depth` blocks of the 32,
random weights), in float32 on this machine's CPU. vLLM's tower is built
outside vLLM's engine: a one-process parallel state, the weights loaded with
its own `load_weights` and `process_weights_after_loading`. Each round runs
one mixed batch of images through both, alternating, so machine noise falls
on both alike. Prints the largest difference between their outputs and
images per second for each. With `--bf16-error`, instead: each tower's
bfloat16 tokens against the float32 reference (the same weights, rounded),
as ‖bf16 − fp32‖ / ‖fp32‖: the precision the encoder gives up in bfloat16,
beside what vLLM's own tower gives up.

Run: python -m bench.towers [--depth 4] [--rounds 5] [--bf16-error]
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch

# (height, width): a mix of the sizes the load tester sends, after a 1 MP budget
SIZES = [(448, 448), (252, 644), (728, 1288), (1092, 812), (224, 224), (504, 504)]


def qwen25_7b_vision(depth: int):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    full = [depth - 1]  # the 7B's full-attention blocks are every 8th; keep one, last
    return Qwen2_5_VLVisionConfig(
        depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, out_hidden_size=3584,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=full,
        hidden_act="silu",
    )


def transformers_tower(vision_config) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config, dtype=torch.float32)
    for parameter in tower.parameters():  # random weights of a trained tower's scale (init leaves some at zero)
        torch.nn.init.normal_(parameter, std=0.02)
    return tower.eval()


def vllm_tower(vision_config, state: dict[str, torch.Tensor], model_dir: str, dtype: str = "float32"):
    """vLLM's Qwen2.5-VL tower, standing alone; its config context is returned for the forward."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer

    config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype=dtype))  # any checkpoint: dtype and backends
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():  # once per process
            init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:29555",
                                         local_rank=0, backend="gloo")
            initialize_model_parallel(1, 1)
        tower = Qwen2_5_VisionTransformer(vision_config, norm_eps=1e-6, prefix="visual")
        tower.load_weights(state.items())
        process_weights_after_loading(tower, config.model_config, torch.device("cpu"))
    return tower.eval(), config


def inputs(patch_size: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The images as Qwen's processor flattens them: (Σ patches, 3·2·14·14) and each (t, h, w) grid."""
    rng = np.random.default_rng(0)
    rows, grids = [], []
    for height, width in SIZES:
        h, w = height // patch_size, width // patch_size
        assert h % merge == 0 and w % merge == 0, (height, width)
        rows.append(rng.standard_normal((h * w, 3 * 2 * patch_size * patch_size), dtype=np.float32))
        grids.append((1, h, w))
    return torch.from_numpy(np.concatenate(rows)), torch.tensor(grids)


def bf16_errors(vision, ours, theirs, config, pixels: torch.Tensor, grid: torch.Tensor, model_dir: str) -> None:
    """Both towers in bfloat16 against transformers' float32 tokens (the two agree in float32)."""
    from vllm.config import set_current_vllm_config

    from vision_encoder.towers.patch_matmul import patch_convs_as_matmul

    def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
        return float((x.float() - reference).norm() / reference.norm())

    with torch.inference_mode(), set_current_vllm_config(config):
        reference = ours(pixels, grid_thw=grid).pooler_output
        theirs32 = theirs(pixels, grid_thw=grid.tolist())
    prism = copy.deepcopy(ours).to(torch.bfloat16)
    patch_convs_as_matmul(prism, torch.device("cpu"))  # as the encoder runs it
    state16 = {k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()}
    theirs_bf16, config16 = vllm_tower(vision, state16, model_dir, "bfloat16")  # vLLM packs its weights per dtype
    with torch.inference_mode(), set_current_vllm_config(config16):
        ours16 = prism(pixels.bfloat16(), grid_thw=grid).pooler_output
        theirs16 = theirs_bf16(pixels.bfloat16(), grid_thw=grid.tolist())
    print(f"float32: vLLM's tower against transformers' {relative(theirs32, reference):.2e}")
    print(f"bfloat16 against the float32 reference: Prism's tower {relative(ours16, reference):.2e}, "
          f"vLLM's tower {relative(theirs16, reference):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bf16-error", action="store_true", help="each tower's bfloat16 error, not the timings")
    args = parser.parse_args()
    from prism.demo_model import RANDOM_MODEL, ensure_demo_model
    from vllm.config import set_current_vllm_config

    vision = qwen25_7b_vision(args.depth)
    ours = transformers_tower(vision)
    theirs, config = vllm_tower(vision, {k: v.clone() for k, v in ours.state_dict().items()}, str(ensure_demo_model(RANDOM_MODEL)))
    pixels, grid = inputs(vision.patch_size, vision.spatial_merge_size)
    if args.bf16_error:
        bf16_errors(vision, ours, theirs, config, pixels, grid, str(ensure_demo_model(RANDOM_MODEL)))
        return
    times: dict[str, list[float]] = {"transformers": [], "vllm": []}
    with torch.inference_mode(), set_current_vllm_config(config):
        for _ in range(args.rounds + 1):  # the first round warms both up and is not counted
            started = time.perf_counter()
            a = ours(pixels, grid_thw=grid).pooler_output
            middle = time.perf_counter()
            b = theirs(pixels, grid_thw=grid.tolist())
            times["transformers"].append(middle - started)
            times["vllm"].append(time.perf_counter() - middle)
    scale = float(a.abs().max())
    print(f"Qwen2.5-VL-7B widths, {args.depth} blocks, float32, {torch.get_num_threads()} threads; "
          f"{len(SIZES)} images ({pixels.shape[0]} patches) per batch, {args.rounds} rounds")
    print(f"outputs {tuple(a.shape)}: largest difference {float((a - b).abs().max()):.2e} (largest value {scale:.2e})")
    for name, runs in times.items():
        median = float(np.median(runs[1:]))
        print(f"{name:>12}: {median * 1000:8.1f} ms per batch, {len(SIZES) / median:6.2f} images/s")
    ratio = np.median(times["vllm"][1:]) / np.median(times["transformers"][1:])
    print(f"vLLM's tower takes {ratio:.2f}x transformers' time")


if __name__ == "__main__":
    main()
