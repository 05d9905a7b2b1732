"""The gateway's visual-token count of an image equals the placeholder count
vLLM puts in the prompt, for 50 random sizes per family. The gateway computes
it from the image's header and the numbers the encoder's handshake gives it.

- Qwen's families: grid t·h·w / merge², from the family's own HF processor.
- LLaVA-OneVision, LLaVA-NeXT and InternVL3 (families that tile images their
  own way): vLLM's own `get_num_image_tokens`, and the length of the features
  the encoder's tower gives, both for the original image and for the smaller
  one the gateway sends with the original size beside it.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from gateway.intake.images import IntakePolicy, ImageLimits, PixelBudget
from gateway.intake.resize import resize_pixels
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from common.tiles import TileLayout
from prism.tiny_models import ensure_tiny_model
from protocol.to_gateway import ProcessorInfo
from vision_encoder.towers.tower import TowerImage
from vision_encoder.towers import load_tower

CHECKPOINTS = {
    "qwen2-vl": lambda: ensure_demo_model(RANDOM_MODEL),
    "qwen2.5-vl": lambda: ensure_tiny_model("qwen2.5-vl"),
    "qwen3-vl": lambda: ensure_tiny_model("qwen3-vl"),
}
LIMITS = ImageLimits(1, 1, 1, 200)


def random_sizes(seed: int, count: int = 50, largest: int = 2400) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes = []
    while len(sizes) < count:
        height, width = rng.randint(8, largest), rng.randint(8, largest)
        if max(height, width) / min(height, width) <= 200:
            sizes.append((height, width))
    return sizes


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_the_gateway_counts_the_placeholders_vllm_will_expand(family):
    processor = AutoImageProcessor.from_pretrained(CHECKPOINTS[family]())
    info = ProcessorInfo(processor.patch_size, processor.merge_size, processor.size["shortest_edge"], processor.size["longest_edge"])
    policy = IntakePolicy(info, LIMITS)
    budget = PixelBudget(info.min_pixels, info.max_pixels)
    for height, width in random_sizes(seed=len(family)):
        ours = policy.visual_tokens(height, width, policy.target(height, width, budget))
        grid = processor(images=[np.zeros((height, width, 3), np.uint8)], return_tensors="np")["image_grid_thw"][0]
        assert ours == int(np.prod(grid)) // processor.merge_size**2, (family, height, width)


@pytest.fixture(scope="module", params=["llava-onevision", "llava-next", "internvl3"])
def anyres(request):
    """A tower of each family that tiles images its own way."""
    return load_tower(str(ensure_tiny_model(request.param)), "float32", "cpu")


def vllm_count(info, height: int, width: int) -> int:
    if "processor" in inspect.signature(info.get_num_image_tokens).parameters:  # InternVL's takes its processor
        return info.get_num_image_tokens(image_width=width, image_height=height, processor=info.get_hf_processor(), mm_kwargs={})
    return info.get_num_image_tokens(image_width=width, image_height=height)


def test_tiled_counts_equal_vllm_s(anyres):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    vllm_info = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=anyres.model_id)).info
    policy = IntakePolicy(anyres.processor_info, LIMITS)
    for height, width in random_sizes(seed=11, largest=1600):
        ours = policy.visual_tokens(height, width, policy.target(height, width, policy.default_budget))
        assert ours == vllm_count(vllm_info, height, width), (height, width)


def test_an_image_turned_by_its_exif_orientation_is_counted_as_turned(anyres):
    """vLLM counts (and the encoder tiles) the image as its EXIF orientation shows it: a tiling
    family's grid is not symmetric in height and width."""
    import io

    from PIL import ExifTags

    from gateway.intake.images import inspect as inspect_image
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    vllm_info = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=anyres.model_id)).info
    policy = IntakePolicy(anyres.processor_info, ImageLimits(20 * 2**20, 50_000_000, 1, 200))
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # turned 90°: shown 1000 tall, 448 wide
    stored = io.BytesIO()
    Image.new("RGB", (1000, 448), (90, 120, 30)).save(stored, "JPEG", exif=exif.tobytes())
    counted = inspect_image(stored.getvalue(), "img", policy, policy.default_budget).visual_tokens
    assert counted == vllm_count(vllm_info, 1000, 448), (counted, vllm_count(vllm_info, 448, 1000))


def test_internvl_finds_the_original_grid_in_the_smaller_image_it_is_sent():
    """The encoder holds InternVL's processor to the original's tile count; within that count the
    closest aspect ratio of the smaller image is the original's grid, for every size tried."""
    for tile in (448, 112):
        layout = TileLayout(tile, 1, 12, True, 256)
        for height, width in random_sizes(seed=tile, count=2000, largest=8000):
            sent = layout.sent_size(height, width)
            if sent == (height, width):
                continue
            cols, rows = layout.grid(height, width)
            held = replace(layout, min_tiles=cols * rows, max_tiles=cols * rows)
            assert held.grid(*sent) == (cols, rows), (tile, height, width)


def test_tiled_features_have_the_counted_length_as_sent_by_the_gateway(anyres):
    """The gateway scales an image down to what the tiles hold and sends the original size; the
    tower's features are as long as counted, as from the full image (vLLM's path)."""
    policy = IntakePolicy(anyres.processor_info, LIMITS)
    rng = np.random.default_rng(0)
    sizes = random_sizes(seed=12, count=12, largest=900) + [(40, 900), (900, 40), (20, 12)]
    full, sent, counted = [], [], []
    for height, width in sizes:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        target_h, target_w = policy.target(height, width, policy.default_budget)
        smaller = resize_pixels(Image.fromarray(pixels), target_w, target_h)
        full.append(TowerImage(pixels, (height, width)))
        sent.append(TowerImage(smaller, (height, width)))
        counted.append(policy.visual_tokens(height, width, (target_h, target_w)))
    lengths = [[len(tokens) for tokens, _ in anyres.encode(anyres.preprocess(batch))] for batch in (full, sent)]
    assert lengths[0] == lengths[1] == counted
    assert sum(h * w > t_h * t_w for (h, w), (t_h, t_w) in
               ((s, policy.target(*s, policy.default_budget)) for s in sizes)) >= 5  # most were scaled down


@pytest.mark.parametrize("family", ["llava-onevision", "internvl3"])
def test_a_qwen_pixel_budget_stops_a_tiled_family_at_start_up(family):
    with pytest.raises(ValueError, match=r"encoder.min_pixels / encoder.max_pixels set a Qwen pixel budget; (LLaVA-OneVision|InternVL3) tiles"):
        load_tower(str(ensure_tiny_model(family)), "float32", "cpu", max_pixels=200704)


def test_a_three_pixel_tall_image_is_read_channels_last(anyres):
    """(3, w, 3) pixels look channels-first to a processor that guesses; vLLM gives it a PIL
    image, whose layout is never guessed. The tower's pixels must be those."""
    pixels = np.random.default_rng(3).integers(0, 256, (3, 300, 3), dtype=np.uint8)
    ours = anyres.preprocess([TowerImage(pixels, (3, 300))]).pixel_values
    theirs = anyres.processor(images=[Image.fromarray(pixels)], return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape and torch.allclose(ours.float(), theirs.float(), atol=1e-5)


@pytest.fixture(scope="module")
def qwen_7b_budget():
    """Qwen2.5-VL's tower at configs/qwen2.5-vl-7b.yaml's pixel budget."""
    return load_tower(str(ensure_tiny_model("qwen2.5-vl")), "float32", "cpu", min_pixels=200_704, max_pixels=1_003_520)


@pytest.mark.parametrize("height,width,budget", [
    (16_000, 100, None),  # a banner: rounding its short side up passes 200:1, which smart_resize refuses
    (1_080, 1_920, PixelBudget(200_704, 200_704)),  # a request's max_pixels: sized below the deployment's min
    (1_000, 999, PixelBudget(200_704, 200_704)),
    (3_000, 4_000, None),  # the deployment's budget, scaled down: as before
])
def test_an_image_the_gateway_sized_keeps_the_grid_vllm_gives_its_original(qwen_7b_budget, height, width, budget):
    """vLLM sizes the original once, under the request's budget. The gateway sends that size; the
    encoder must not size it again under the deployment's."""
    tower = qwen_7b_budget
    policy = IntakePolicy(tower.processor_info, LIMITS)
    budget = budget or policy.default_budget
    original = np.random.default_rng(height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    target_h, target_w = policy.target(height, width, budget)
    sent = TowerImage(resize_pixels(Image.fromarray(original), target_w, target_h), (height, width))
    size = {"shortest_edge": budget.min_pixels, "longest_edge": budget.max_pixels}  # a request's mm_processor_kwargs
    vllm_grid = tower.processor(images=[Image.fromarray(original)], size=size, return_tensors="pt")["image_grid_thw"][0].tolist()
    batch = tower.preprocess([sent, TowerImage(original[:300, :400].copy(), (300, 400))])  # beside one it sizes itself
    assert batch.grid_thw[0].tolist() == vllm_grid
    assert tower.patches_of(sent) == vllm_grid[1] * vllm_grid[2]
    assert batch.pixel_values.shape[0] == sum(int(np.prod(grid)) for grid in batch.grid_thw.tolist())
    tokens = [len(t) for t, _ in tower.encode(batch)]
    assert tokens[0] == policy.visual_tokens(height, width, (target_h, target_w)) == vllm_grid[1] * vllm_grid[2] // 4


def test_an_image_already_at_its_request_s_size_is_said_to_be_and_kept():
    """`detail: low` under a deployment whose min_pixels is over detail_low_max_pixels: a 448²
    image is already what the low budget makes of it, so the gateway sends it as it is; the
    encoder used to take an image the gateway did not resize for one to size under its own
    budget (644², 529 tokens, where the gateway counted 256)."""
    from gateway.intake.images import decode, inspect
    from loadtest.synthetic import encode, make_image

    tower = load_tower(str(ensure_tiny_model("qwen2.5-vl")), "float32", "cpu", min_pixels=401_408, max_pixels=1_003_520)
    policy = IntakePolicy(tower.processor_info, ImageLimits(2**24, 2**26, 2, 200))
    low = PixelBudget(200_704, 200_704)
    raw = encode(make_image("low", (448, 448)), "PNG")
    prepared = decode(inspect(raw, "image", policy, low), policy)
    assert prepared.sized and prepared.pixels.shape[:2] == (448, 448)
    assert not decode(inspect(raw, "image", policy, policy.default_budget), policy).sized  # its processor rounds it
    sent = TowerImage(prepared.pixels, (448, 448), prepared.sized)
    (tokens, grid), = tower.encode(tower.preprocess([sent]))
    assert grid == (1, 32, 32) and len(tokens) == policy.visual_tokens(448, 448, (448, 448)) == 256
