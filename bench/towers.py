"""Which vision tower the encoder should run: transformers' (what it runs) or
vLLM's own, side by side in one process on the same weights and inputs.

Qwen2.5-VL's tower at Qwen2.5-VL-7B's widths (1280 wide, 16 heads, windowed
attention with a full-attention block) or Qwen3-VL's at Qwen3-VL-8B's (1152
wide, patch 16, DeepStack), or SigLIP-so400m's as LLaVA-OneVision-7B has it
(1152 wide, tiles of 384), or InternViT-300M's as InternVL3-8B has it (1024
wide, tiles of 448), `--depth` blocks, random weights, on this
machine's CPU. vLLM's tower is built outside vLLM's engine as its model
loader builds it: under the checkpoint's dtype as torch's default (vLLM
sizes its parameters and its rotary table by it), in a one-process parallel
state, the weights loaded with its own `load_weights` and
`process_weights_after_loading`. Each round runs one mixed batch of images
through both, alternating, so machine noise falls on both alike. Prints the
largest difference between their float32 outputs and images per second for
each. With `--bf16-error`, instead: each tower in bfloat16 against the
float32 reference (transformers' tower on the same weights), as
‖bf16 − fp32‖ / ‖fp32‖, stage by stage (after the patch embedding, each
block, Qwen's merger; in the towers' own window order), beside the reference
rounded once to bfloat16: the precision the encoder gives up, beside what
vLLM's own tower gives up.

Run: python -m bench.towers [--family qwen2.5-vl|qwen3-vl|siglip|internvit] [--depth 4] [--rounds 5] [--bf16-error]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# (height, width) over 14-pixel patches: a mix of the sizes the load tester sends,
# after a 1 MP budget; Qwen3-VL's 16-pixel patches keep the same grids
SIZES = [(448, 448), (252, 644), (728, 1288), (1092, 812), (224, 224), (504, 504)]
PATCH_GRID = 14


@dataclass(frozen=True)
class TowerFamily:
    config: Callable[..., object]  # (depth, **widths) → the transformers vision config
    transformers_class: str  # module:class
    vllm_class: str
    stages: Callable[[torch.nn.Module], dict[str, torch.nn.Module]]  # either tower's stages, by name, in order
    ours: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor]  # transformers' tokens
    theirs: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor]  # vLLM's tokens
    vllm_kwargs: tuple[tuple[str, object], ...] = (("norm_eps", 1e-6),)
    state_prefix: str = ""  # what transformers' names have that vLLM's module does not


def qwen25_vision(depth: int, hidden: int = 1280, intermediate: int = 3420, heads: int = 16, out: int = 3584):
    """Qwen2.5-VL-7B's vision config (or narrower), `depth` blocks, the last one full attention."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    full = [depth - 1]  # the 7B's full-attention blocks are every 8th; keep one, last
    return Qwen2_5_VLVisionConfig(
        depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads, in_channels=3,
        out_hidden_size=out, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=full, hidden_act="silu",
    )


def qwen3_vision(depth: int, hidden: int = 1152, intermediate: int = 4304, heads: int = 16, out: int = 4096):
    """Qwen3-VL-8B's vision config (or narrower), `depth` blocks, DeepStack taps spread as the 8B's (8/16/24 of 27)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    taps = sorted({max(0, round(depth * k / 27) - 1) for k in (9, 17, 25)})
    return Qwen3VLVisionConfig(
        depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads, in_channels=3,
        out_hidden_size=out, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
        deepstack_visual_indexes=taps, hidden_act="gelu_pytorch_tanh",
    )


def siglip_vision(depth: int, hidden: int = 1152, intermediate: int = 4304, heads: int = 16, out: int = 0):
    """SigLIP-so400m as LLaVA-OneVision-7B has it (tiles of 384), `depth` layers; `out` is unused (no merger)."""
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=depth,
                              num_attention_heads=heads, image_size=384, patch_size=14, hidden_act="gelu_pytorch_tanh")


def internvit_vision(depth: int, hidden: int = 1024, intermediate: int = 4096, heads: int = 16, out: int = 0):
    """InternViT-300M as InternVL3-8B has it (tiles of 448), `depth` layers; `out` is unused (no merger)."""
    from transformers import InternVLVisionConfig

    return InternVLVisionConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=depth,
                                num_attention_heads=heads, image_size=[448, 448], patch_size=[14, 14])


def qwen_stages(tower: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {"patch embedding": tower.patch_embed, **{f"block {i}": b for i, b in enumerate(tower.blocks)},
            "merger": tower.merger}


def siglip_stages(tower: torch.nn.Module) -> dict[str, torch.nn.Module]:
    vit = getattr(tower, "vision_model", tower)  # transformers' model wraps the transformer vLLM builds alone
    return {"patch embedding": vit.embeddings, **{f"block {i}": b for i, b in enumerate(vit.encoder.layers)}}


def internvit_stages(tower: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {"patch embedding": tower.embeddings, **{f"block {i}": b for i, b in enumerate(tower.encoder.layer)}}


def qwen_tokens(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """The merger's tokens, followed by DeepStack's as vLLM returns them (and the encoder sends them)."""
    out = tower(pixels, grid_thw=grid)
    return torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)


def siglip_tokens(tower: torch.nn.Module, pixels: torch.Tensor, grid: None) -> torch.Tensor:
    """The last layer's hidden states, before the post-norm: LLaVA-OneVision's feature layer -1."""
    return tower(pixels, output_hidden_states=True).hidden_states[-1]


FAMILIES = {
    "qwen2.5-vl": TowerFamily(qwen25_vision, "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
                              "vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VisionTransformer", qwen_stages, qwen_tokens,
                              lambda tower, pixels, grid: tower(pixels, grid_thw=grid.tolist())),
    "qwen3-vl": TowerFamily(qwen3_vision, "transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
                            "vllm.model_executor.models.qwen3_vl:Qwen3_VisionTransformer", qwen_stages, qwen_tokens,
                            lambda tower, pixels, grid: tower(pixels, grid_thw=grid.tolist())),
    "siglip": TowerFamily(siglip_vision, "transformers:SiglipVisionModel",
                          "vllm.model_executor.models.siglip:SiglipVisionTransformer", siglip_stages, siglip_tokens,
                          lambda tower, pixels, grid: tower(pixels),
                          (("require_post_norm", False), ("use_head", False)), "vision_model."),
    # vLLM runs InternVL's transformers-format checkpoints (-hf) with InternS1's vision model
    "internvit": TowerFamily(internvit_vision, "transformers:InternVLVisionModel",
                             "vllm.model_executor.models.interns1_vit:InternS1VisionModel", internvit_stages,
                             lambda tower, pixels, grid: tower(pixels).last_hidden_state,
                             lambda tower, pixels, grid: tower(pixels), ()),
}


def _class(path: str) -> type:
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def transformers_tower(family: TowerFamily, vision_config) -> torch.nn.Module:
    torch.manual_seed(0)
    tower = _class(family.transformers_class)._from_config(vision_config, dtype=torch.float32)
    for parameter in tower.parameters():  # random weights of a trained tower's scale (init leaves some at zero)
        torch.nn.init.normal_(parameter, std=0.02)
    return tower.eval()


def vllm_tower(family: TowerFamily, vision_config, state: dict[str, torch.Tensor], model_dir: str,
               dtype: str = "float32", port: int | None = None):
    """vLLM's tower, standing alone, built as its model loader builds it; its config context is returned for the forward."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype=dtype))  # any checkpoint: dtype and backends
    # vLLM's loader builds every model under its dtype as torch's default (base_loader.py): the
    # parameters, and the rotary table the tower computes with, are made in it
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        if not model_parallel_is_initialized():  # once per process
            from testing.stack import free_port

            port = port or free_port()  # its TCP store: another run of this bench may hold any fixed port
            init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                         local_rank=0, backend="gloo")
            initialize_model_parallel(1, 1)
        tower = _class(family.vllm_class)(vision_config, prefix="visual", **dict(family.vllm_kwargs))
        tower.load_weights((name.removeprefix(family.state_prefix), weight) for name, weight in state.items())
        process_weights_after_loading(tower, config.model_config, torch.device("cpu"))
    return tower.eval(), config


def inputs(vision, sizes=SIZES) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qwen: the images as its processor flattens them, (Σ patches, 3·2·p·p), and each (t, h, w) grid;
    SigLIP, InternViT: one tile per image, no grid."""
    rng = np.random.default_rng(0)
    if not hasattr(vision, "spatial_merge_size"):
        side = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
        return torch.from_numpy(rng.standard_normal((len(sizes), 3, side, side), dtype=np.float32)), None
    patch_size, merge = vision.patch_size, vision.spatial_merge_size
    rows, grids = [], []
    for height, width in sizes:
        h, w = height // PATCH_GRID, width // PATCH_GRID
        assert h % merge == 0 and w % merge == 0, (height, width)
        rows.append(rng.standard_normal((h * w, 3 * 2 * patch_size * patch_size), dtype=np.float32))
        grids.append((1, h, w))
    return torch.from_numpy(np.concatenate(rows)), torch.tensor(grids)


def staged(stages: dict[str, torch.nn.Module], run: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`run()`'s output and what each stage gave on the way, in float32, one row per token (Qwen) or tile.
    The stages' forwards are wrapped, not hooked: vLLM's compilable modules call `forward` directly."""
    outputs: dict[str, torch.Tensor] = {}

    def recording(name: str, forward: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            out = forward(*args, **kwargs)
            tensor = out[0] if isinstance(out, tuple) else out  # vLLM's linear layers return (out, bias)
            outputs[name] = tensor.detach().float().reshape(tensor.shape[0], -1)
            return out

        return wrapped

    for name, module in stages.items():
        module.forward = recording(name, module.forward)
    try:
        with torch.inference_mode():
            outputs["tokens"] = run().float()
    finally:
        for module in stages.values():
            del module.forward  # the class's own again
    return outputs


def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.float() - reference).norm() / reference.norm())


def bf16_errors(family: TowerFamily, vision, ours, pixels: torch.Tensor, grid: torch.Tensor, model_dir: str,
                port: int | None = None) -> dict[str, dict[str, float]]:
    """Each stage's ‖bf16 − fp32‖ / ‖fp32‖: Prism's tower (transformers' modules as vision_encoder
    runs them), vLLM's, and the float32 reference rounded once to bfloat16."""
    from vllm.config import set_current_vllm_config

    from vision_encoder.towers.patch_matmul import patch_convs_as_matmul

    reference = staged(family.stages(ours), lambda: family.ours(ours, pixels, grid))
    prism = copy.deepcopy(ours).to(torch.bfloat16)
    patch_convs_as_matmul(prism, torch.device("cpu"))  # as the encoder runs it
    state16 = {k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()}
    theirs, config = vllm_tower(family, vision, state16, model_dir, "bfloat16", port)  # vLLM packs its weights per dtype
    pixels16 = pixels.bfloat16()
    runs = {"Prism": staged(family.stages(prism), lambda: family.ours(prism, pixels16, grid))}
    with set_current_vllm_config(config):
        runs["vLLM"] = staged(family.stages(theirs), lambda: family.theirs(theirs, pixels16, grid))
    runs["fp32 rounded once"] = {k: v.bfloat16() for k, v in reference.items()}
    return {name: {stage: relative(out[stage], reference[stage]) for stage in reference} for name, out in runs.items()}


def print_bf16_errors(errors: dict[str, dict[str, float]]) -> None:
    names = list(errors)
    print("bfloat16 against the float32 reference, ‖bf16 − fp32‖ / ‖fp32‖, stage by stage:")
    print(f"{'stage':>16} " + " ".join(f"{n:>18}" for n in names))
    for stage in errors[names[0]]:
        print(f"{stage:>16} " + " ".join(f"{errors[n][stage]:18.3e}" for n in names))


def compare_timings(name: str, family: TowerFamily, ours, theirs, config, pixels, grid, rounds: int, depth: int) -> None:
    from vllm.config import set_current_vllm_config

    times: dict[str, list[float]] = {"transformers": [], "vllm": []}
    with torch.inference_mode(), set_current_vllm_config(config):
        for _ in range(rounds + 1):  # the first round warms both up and is not counted
            started = time.perf_counter()
            a = family.ours(ours, pixels, grid)
            middle = time.perf_counter()
            b = family.theirs(theirs, pixels, grid)
            times["transformers"].append(middle - started)
            times["vllm"].append(time.perf_counter() - middle)
    scale = float(a.abs().max())
    print(f"{name}, {depth} blocks, float32, {torch.get_num_threads()} threads; "
          f"{len(SIZES)} images ({pixels.shape[0]} patches or tiles) per batch, {rounds} rounds")
    print(f"outputs {tuple(a.shape)}: largest difference {float((a - b).abs().max()):.2e} (largest value {scale:.2e})")
    for name, runs in times.items():
        median = float(np.median(runs[1:]))
        print(f"{name:>12}: {median * 1000:8.1f} ms per batch, {len(SIZES) / median:6.2f} images/s")
    ratio = np.median(times["vllm"][1:]) / np.median(times["transformers"][1:])
    print(f"vLLM's tower takes {ratio:.2f}x transformers' time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2.5-vl")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bf16-error", action="store_true", help="each tower's bfloat16 error, not the timings")
    args = parser.parse_args()
    from prism.demo_model import RANDOM_MODEL, ensure_demo_model

    family = FAMILIES[args.family]
    model_dir = str(ensure_demo_model(RANDOM_MODEL))
    vision = family.config(args.depth)
    ours = transformers_tower(family, vision)
    pixels, grid = inputs(vision)
    if args.bf16_error:
        print(f"{args.family}, {args.depth} blocks, {len(SIZES)} images ({pixels.shape[0]} patches or tiles)")
        print_bf16_errors(bf16_errors(family, vision, ours, pixels, grid, model_dir))
        return
    theirs, config = vllm_tower(family, vision, {k: v.clone() for k, v in ours.state_dict().items()}, model_dir)
    compare_timings(args.family, family, ours, theirs, config, pixels, grid, args.rounds, args.depth)


if __name__ == "__main__":
    main()
