"""Train the demo model that sees: a tiny Qwen2-VL on synthetic shape scenes.

Every batch is drawn fresh from a seeded generator (prism/scenes.py,
prism/scene_clips.py) and passed through the same image and video processors
the encoder service loads. Four phases, deterministic for a given seed and
thread count, CPU only:

1. The vision tower alone learns to read scenes (2000 steps): a small
   probe on its visual tokens (SceneHeads, thrown away afterwards) must say,
   for each shape kind, whether it is there and in which colour, and every
   token which shape and colour it belongs to. The language model is not run.
2. The merger and the language model on the answers (3000 steps;
   loss on the answer tokens only), the tower's blocks frozen, the probe's
   loss kept beside.
3. JSON answers about one-shape scenes (400 steps): the language model
   alone, at a low rate, with plain questions in every batch (`teach_json`).
4. "What colour does the square turn?" about short clips in which one shape
   changes colour half-way (240 steps): the language model alone again, the
   clips as mp4 bytes through vLLM's own loader and the checkpoint's video
   processor, so it learns on the frames the served path hands it; image and
   JSON questions in every batch (`teach_video`).

Why (the runs: docs/measurements/accuracy.md): answers alone teach a
from-scratch tower slowly, and so does a per-token label alone; the ViT needs
a few hundred steps of direct signal before shape emerges at all. With the
tower still training in phase 2, colour questions stalled (the model named
another shape's colour in scenes of three); frozen, they pass their bar, and
a step costs half as much.

Run: python -m prism.train_demo --out models/prism-shapes
     python -m prism.train_demo --json-from models/prism-shapes   # phase 4 alone, on the committed weights
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from prism import scene_clips, scenes
from prism.demo_model import build_config, build_tokenizer, save_checkpoint, write_processor_configs

MAX_PIXELS = 140 * 140  # every image is resized to at most this (5×5 visual tokens) before the ViT
MIN_PIXELS = 56 * 56
SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    steps: int = 3000
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    threads: int = 2
    vision_depth: int = 4
    vision_width: int = 128
    vision_heads: int = 4
    text_layers: int = 3
    text_kv_heads: int = 1
    text_intermediate: int = 512
    min_side: int = 96
    max_side: int = 384
    vision_steps: int = 2000  # phase 1: the tower alone, against the scene probe
    aux_weight: float = 1.0  # phase 2: the probe's loss, beside the answer loss
    vision_lr_scale: float = 0.3  # phase 2: the merger's (and probe's) learning rate, relative
    json_steps: int = 400  # phase 3: JSON answers taught to the finished model
    json_lr: float = 5e-4
    json_share: int = 12  # phase 3: JSON samples per batch, the rest plain questions so none is forgotten
    video_steps: int = 240  # phase 4: a video question taught to the finished model
    video_lr: float = 1e-3
    video_warmup: int = 20
    video_batch_size: int = 16  # phase 4's batches are smaller: a clip costs twice an image's tokens
    video_share: int = 6  # phase 4: clips per batch
    video_json_share: int = 1  # phase 4: JSON samples per batch beside them; the rest plain questions


def _corpus_lines() -> list[str]:
    """Every word the templates and answers can use, so the tokenizer keeps them whole."""
    lines = [t for kind in scenes.KINDS for t in scenes.TEMPLATES[kind]]  # the tokenizer predates JSON
    for shape in scenes.SHAPES:
        for colour in scenes.COLOURS:
            lines += [f"a {colour} {shape}", f"an {colour} {shape}", f"What colour is the {shape}?", f"Which shape is {colour}?"]
    lines += [" ".join(scenes.COUNT_WORDS), SYSTEM]
    return lines * 20


def build(recipe: Recipe):
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer = build_tokenizer(recipe.seed, _corpus_lines())
    vision = dict(depth=recipe.vision_depth, embed_dim=recipe.vision_width, num_heads=recipe.vision_heads)
    config = build_config(tokenizer, recipe.text_layers, recipe.text_intermediate, vision, recipe.text_kv_heads)
    torch.manual_seed(recipe.seed)
    return Qwen2VLForConditionalGeneration(config), tokenizer


def processors(workdir: Path):
    """The image and video processors exactly as the encoder service will load them from the checkpoint."""
    from transformers import AutoImageProcessor, AutoVideoProcessor

    workdir.mkdir(parents=True, exist_ok=True)
    write_processor_configs(workdir, MAX_PIXELS, MIN_PIXELS)
    return AutoImageProcessor.from_pretrained(workdir), AutoVideoProcessor.from_pretrained(workdir)


def is_clip(media) -> bool:
    """A sample's media: a PIL image, or a clip's served frames (uint8 (T, H, W, 3))."""
    return isinstance(media, np.ndarray)


# Per medium: the chat part, its placeholder token, and its mm_token_type_ids value (M-RoPE's).
MEDIA = {False: ("image", "<|image_pad|>", 1), True: ("video", "<|video_pad|>", 2)}


class Batcher:
    """Turns (image or clip, question, answer, scene) samples into model inputs with answer-only labels."""

    def __init__(self, tokenizer, processor, video_processor=None):
        self.tokenizer = tokenizer
        self.processor = processor
        self.video_processor = video_processor
        self.type_of = {tokenizer.convert_tokens_to_ids(pad): value for _, pad, value in MEDIA.values()}
        self.merge = processor.merge_size**2

    def prompt_ids(self, question: str, tokens: int, clip: bool = False) -> list[int]:
        part, pad, _ = MEDIA[clip]
        messages = [{"role": "user", "content": [{"type": part}, {"type": "text", "text": question}]}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text = text.replace(pad, pad * tokens)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _visual_inputs(self, samples: list[tuple]) -> tuple[dict, list[int]]:
        """The processors' outputs, and each sample's count of visual tokens (images and clips in their order)."""
        images = [media for media, *_ in samples if not is_clip(media)]
        clips = [media for media, *_ in samples if is_clip(media)]
        inputs, tokens = {}, {False: iter(()), True: iter(())}
        if images:
            vision = self.processor(images=images, return_tensors="pt")
            inputs |= {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
            tokens[False] = iter((vision["image_grid_thw"].prod(-1) // self.merge).tolist())
        if clips:
            video = self.video_processor(videos=clips, return_tensors="pt")
            inputs |= {"pixel_values_videos": video["pixel_values_videos"], "video_grid_thw": video["video_grid_thw"]}
            tokens[True] = iter((video["video_grid_thw"].prod(-1) // self.merge).tolist())
        return inputs, [next(tokens[is_clip(media)]) for media, *_ in samples]

    def __call__(self, samples: list[tuple]) -> dict[str, torch.Tensor]:
        visual, tokens = self._visual_inputs(samples)
        rows, labels = [], []
        for (media, question, answer, _), n in zip(samples, tokens):
            prompt = self.prompt_ids(question, n, is_clip(media))
            target = self.tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
            rows.append(prompt + target)
            labels.append([-100] * len(prompt) + target)
        width = max(map(len, rows))
        pad_id = self.tokenizer.pad_token_id
        input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
        token_types = torch.zeros_like(input_ids)  # M-RoPE's: 0 text, 1 image, 2 video
        for pad, value in self.type_of.items():
            token_types[input_ids == pad] = value
        return {
            "input_ids": input_ids,
            "mm_token_type_ids": token_types,
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([l + [-100] * (width - len(l)) for l in labels]),
            **visual,
        }


def scene_targets(samples: list[tuple]) -> torch.Tensor:
    """Per image and shape kind: 0 if the kind is absent, else its colour's class."""
    rows = []
    for *_, scene in samples:
        present = {s.kind: s.colour_class for s in scene.shapes}
        rows.append([present.get(kind, 0) for kind in scenes.SHAPES])
    return torch.tensor(rows)


class SceneHeads(torch.nn.Module):
    """Training-only probe on the merger's output (not saved): for each shape
    kind, say whether it is there and in which colour, from the max and the
    mean of an image's visual tokens plus an attention pool with a learned
    query per kind. It asks the tower for what every answer needs (which
    shapes, how many, which colour each) without the language model's cost per
    step. The max gives the tower a direct gradient from the first step; the
    attention pool lets colour be read from the shape's own tokens, the way the
    language model reads it (measured: attention alone learned nothing in 800
    steps, max and mean alone stalled at a loss of 0.3)."""

    def __init__(self, hidden: int):
        super().__init__()
        kinds, classes = len(scenes.SHAPES), len(scenes.COLOURS) + 1
        self.queries = torch.nn.Parameter(torch.randn(kinds, hidden) * hidden**-0.5)
        self.keys = torch.nn.Linear(hidden, hidden)
        self.pooled = torch.nn.Linear(2 * hidden, kinds * classes)
        self.attended = torch.nn.Linear(hidden, classes)
        self.token_shape = torch.nn.Linear(hidden, kinds + 1)
        self.token_colour = torch.nn.Linear(hidden, len(scenes.COLOURS) + 1)

    def forward(self, tokens: torch.Tensor, grids: torch.Tensor, merge: int) -> torch.Tensor:
        pooled, attended = [], []
        for image in torch.split(tokens, (grids.prod(-1) // merge**2).tolist()):
            pooled.append(torch.cat([image.max(0).values, image.mean(0)]))
            attended.append(torch.softmax(self.queries @ self.keys(image).T, dim=-1) @ image)  # (kinds, hidden)
        global_view = self.pooled(torch.stack(pooled)).view(len(pooled), len(scenes.SHAPES), -1)
        return global_view + self.attended(torch.stack(attended))  # (images, kinds, colours + absent)

    def loss(self, tokens: torch.Tensor, samples: list[tuple], grids: torch.Tensor, patch: int, merge: int) -> torch.Tensor:
        """The scene read as a whole, plus every token saying which shape and
        colour it belongs to: the language model finds "the red one" by its
        tokens and reads its shape there, so each token must carry both."""
        cross = torch.nn.functional.cross_entropy
        scene = cross(self(tokens, grids, merge).flatten(0, 1), scene_targets(samples).flatten())
        shape_ids, colour_ids = token_targets(samples, grids, patch, merge)
        on_shape = shape_ids > 0
        per_token = cross(self.token_colour(tokens), colour_ids) + cross(self.token_shape(tokens[on_shape]), shape_ids[on_shape])
        return scene + per_token


def token_targets(samples: list[tuple], grids: torch.Tensor, patch: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per visual token (in the merger's order: images in turn, rows of tokens):
    the shape and colour classes of the shape covering most of it, 0 for background."""
    shape_ids, colour_ids = [], []
    side = patch * merge
    offsets = (np.arange(3) + 0.5) / 3 * side  # a 3×3 vote inside each token
    for (*_, scene), (_, h, w) in zip(samples, grids.tolist()):
        rows, cols = h // merge, w // merge
        ys = (np.arange(rows)[:, None] * side + offsets)[:, None, :, None]
        xs = (np.arange(cols)[:, None] * side + offsets)[None, :, None, :]
        covered = scene.covering(xs, ys, cols * side, rows * side).reshape(rows * cols, 9)
        votes = np.stack([(covered == k).sum(1) for k in range(len(scene.shapes) + 1)], 1).argmax(1)
        shape_ids.append(np.take([0] + [s.shape_class for s in scene.shapes], votes))
        colour_ids.append(np.take([0] + [s.colour_class for s in scene.shapes], votes))
    return torch.from_numpy(np.concatenate(shape_ids)), torch.from_numpy(np.concatenate(colour_ids))


def draw_samples(rng: random.Random, n: int, recipe: Recipe, kind: str | None = None) -> list[tuple]:
    samples = []
    for _ in range(n):
        scene = scenes.make_scene(rng, 1 if kind == "json" else None)
        question = scenes.ask(scene, rng, kind)
        image = scene.render(*scenes.render_size(scene, rng, recipe.min_side, recipe.max_side))
        samples.append((image, question.text, question.answer, scene))
    return samples


def draw_clips(rng: random.Random, n: int, recipe: Recipe) -> list[tuple]:
    """Clip samples as the served path sees them: mp4 bytes, then the frames vLLM's loader keeps."""
    samples = []
    for _ in range(n):
        clip = scene_clips.make_clip(rng)
        question = clip.question(rng)
        samples.append((scene_clips.served_frames(clip.mp4()), question.text, question.answer, clip.before))
    return samples


@torch.no_grad()
def exact_match(model, batch: dict) -> float:
    """Share of samples whose every answer token is the argmax: what greedy decoding would say."""
    model.eval()
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    model.train()
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    right = ((logits.argmax(-1) == labels) | ~mask).all(-1)
    return right.float().mean().item()


def update(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], loss: torch.Tensor) -> None:
    """One optimiser step on `loss`, gradients clipped to norm 1."""
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


def lr_at(step: int, steps: int, recipe: Recipe, peak: float | None = None, warmup: int | None = None) -> float:
    peak = recipe.lr if peak is None else peak
    warmup = recipe.warmup if warmup is None else warmup
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out_batches(batcher: Batcher, recipe: Recipe, kinds: tuple[str, ...]) -> dict[str, dict]:
    def draw(kind: str) -> list[tuple]:
        rng = random.Random(f"held-out-{kind}")
        return draw_clips(rng, 48, recipe) if kind == scene_clips.KIND else draw_samples(rng, 48, recipe, kind)

    return {kind: batcher(draw(kind)) for kind in kinds}


def log_held_out(phase: str, step: int, loss: float, model, held_out: dict[str, dict], extra: str = "") -> None:
    scores = " ".join(f"{kind} {exact_match(model, b):.2f}" for kind, b in held_out.items())
    print(f"{phase} {step:5d}  loss {loss:.3f}{extra}  held-out {scores}", flush=True)


def pretrain_vision(model, heads: SceneHeads, processor, recipe: Recipe, log_every: int) -> None:
    """Phase 1: the vision tower and the probe alone, no language model."""
    visual = model.model.visual
    params = [*visual.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    rng = random.Random(f"{recipe.seed}-vision")
    for step in range(recipe.vision_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe.vision_steps, recipe)
        samples = draw_samples(rng, recipe.batch_size, recipe)
        pixels = processor(images=[image for image, *_ in samples], return_tensors="pt")
        tokens = visual(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"]).pooler_output
        grids = pixels["image_grid_thw"]
        loss = heads.loss(tokens, samples, grids, processor.patch_size, processor.merge_size)
        update(optimizer, params, loss)
        if step % log_every == 0 or step == recipe.vision_steps - 1:
            right = (heads(tokens.detach(), grids, processor.merge_size).argmax(-1) == scene_targets(samples)).all(-1)
            print(f"vision {step:5d}  loss {loss.item():.3f}  scenes read right {right.float().mean():.2f}", flush=True)


def train_end_to_end(model, heads: SceneHeads, batcher: Batcher, recipe: Recipe, log_every: int) -> None:
    """Phase 2: answers through the language model, the probe's loss kept beside."""
    held_out = held_out_batches(batcher, recipe, scenes.KINDS)
    merged: list[torch.Tensor] = []
    hook = model.model.visual.merger.register_forward_hook(lambda _module, _args, out: merged.append(out))
    # The tower already reads scenes: its blocks stay frozen (which also makes
    # a step half as dear, so the language model gets twice the steps), and
    # only the merger, the projector into the language model, keeps learning,
    # at a gentler rate, with the probe's loss keeping its tokens readable.
    for name, param in model.model.visual.named_parameters():
        param.requires_grad_(name.startswith("merger."))
    vision = [*model.model.visual.merger.parameters(), *heads.parameters()]
    language = [p for name, p in model.named_parameters() if not name.startswith("model.visual.")]
    params = [*vision, *language]
    groups = [{"params": vision, "scale": recipe.vision_lr_scale}, {"params": language, "scale": 1.0}]
    optimizer = torch.optim.AdamW(groups, lr=recipe.lr, weight_decay=recipe.weight_decay)
    rng = random.Random(recipe.seed)
    merge = batcher.processor.merge_size
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe.steps, recipe) * group["scale"]
        samples = draw_samples(rng, recipe.batch_size, recipe)
        batch = batcher(samples)
        merged.clear()
        answer_loss = model(**batch).loss
        scene_loss = heads.loss(merged[0], samples, batch["image_grid_thw"], batcher.processor.patch_size, merge)
        loss = answer_loss + recipe.aux_weight * scene_loss
        update(optimizer, params, loss)
        if step % log_every == 0 or step == recipe.steps - 1:
            log_held_out("answers", step, answer_loss.item(), model, held_out, f"  probe {scene_loss.item():.3f}")
    hook.remove()


def teach_json(model, batcher: Batcher, recipe: Recipe, log_every: int) -> None:
    """Phase 3: JSON answers (`{"shape":"circle","colour":"blue"}` about a
    one-shape scene), taught to the finished model at a low rate with plain
    questions in every batch; the vision tower, merger included, is frozen.
    Why a phase of its own: a fifth question kind mixed into phase 2 answered
    JSON well but cost shape questions their bar in two re-trains
    (docs/measurements/accuracy.md)."""

    def draw(rng: random.Random) -> list[tuple]:
        samples = draw_samples(rng, recipe.json_share, recipe, "json")
        return samples + draw_samples(rng, recipe.batch_size - recipe.json_share, recipe)

    _tune_language(model, batcher, recipe, log_every, "json", (*scenes.KINDS, "json"), recipe.json_steps,
                   recipe.json_lr, recipe.warmup, draw)


def teach_video(model, batcher: Batcher, recipe: Recipe, log_every: int) -> None:
    """Phase 4: "What colour does the <shape> turn?" about clips in which one
    shape changes colour half-way, taught to the finished model as phase 3
    taught JSON: the vision tower frozen (a clip's two temporal patches each
    hold one still picture, which it already reads), the language model at a
    low rate, with JSON and plain questions in every batch so none is
    forgotten. It learns which temporal patch comes last from M-RoPE's time
    axis, and the answer is the named shape's colour there."""
    plain = recipe.video_batch_size - recipe.video_share - recipe.video_json_share

    def draw(rng: random.Random) -> list[tuple]:
        samples = draw_clips(rng, recipe.video_share, recipe)
        samples += draw_samples(rng, recipe.video_json_share, recipe, "json")
        return samples + draw_samples(rng, plain, recipe)

    _tune_language(model, batcher, recipe, log_every, "video", (*scenes.KINDS, "json", scene_clips.KIND),
                   recipe.video_steps, recipe.video_lr, recipe.video_warmup, draw)


def _tune_language(model, batcher: Batcher, recipe: Recipe, log_every: int, phase: str, held_out_kinds: tuple[str, ...],
                   steps: int, peak_lr: float, warmup: int, draw) -> None:
    """Phases 3 and 4: the finished model's language side taught at `peak_lr`, the vision
    tower (merger included) frozen, each batch `draw(rng)` from the phase's own seeded rng."""
    held_out = held_out_batches(batcher, recipe, held_out_kinds)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith("model.visual."))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=peak_lr, weight_decay=recipe.weight_decay)
    rng = random.Random(f"{recipe.seed}-{phase}")
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, recipe, peak_lr, warmup)
        loss = model(**batcher(draw(rng))).loss
        update(optimizer, params, loss)
        if step % log_every == 0 or step == steps - 1:
            log_held_out(phase, step, loss.item(), model, held_out)


def _answers_state(path: Path) -> dict[str, torch.Tensor]:
    """Phase 2's result: a --save-answers file, or a saved checkpoint (such as
    the committed demo model), read in float32."""
    if path.is_dir():
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).state_dict()
    return torch.load(path)


def train(recipe: Recipe, out: Path, log_every: int = 50, vision_from: Path | None = None, save_vision: Path | None = None,
          answers_from: Path | None = None, save_answers: Path | None = None, json_from: Path | None = None) -> Path:
    torch.set_num_threads(recipe.threads)
    started = time.monotonic()
    model, tokenizer = build(recipe)
    heads = SceneHeads(model.config.text_config.hidden_size)
    # Shortcuts: an earlier phase's result from a run of the same recipe (read before `out` is written to).
    start_state = _answers_state(json_from or answers_from) if json_from or answers_from else None
    processor, video_processor = processors(out)
    model.train()
    batcher = Batcher(tokenizer, processor, video_processor)
    if start_state is not None:
        model.load_state_dict(start_state)
    else:
        if vision_from:
            state = torch.load(vision_from)
            model.model.visual.load_state_dict(state["visual"])
            heads.load_state_dict(state["heads"])
        else:
            pretrain_vision(model, heads, processor, recipe, log_every)
            if save_vision:
                torch.save({"visual": model.model.visual.state_dict(), "heads": heads.state_dict()}, save_vision)
        train_end_to_end(model, heads, batcher, recipe, log_every)
        if save_answers:
            torch.save(model.state_dict(), save_answers)
    if not json_from:
        teach_json(model, batcher, recipe, log_every)
    teach_video(model, batcher, recipe, log_every)
    about = {"kind": "trained", "recipe": asdict(recipe), "train_seconds": round(time.monotonic() - started)}
    print(f"trained in {about['train_seconds']} s")
    return save_checkpoint(out, model.to(torch.bfloat16), tokenizer, MAX_PIXELS, MIN_PIXELS, about)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/prism-shapes"))
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--save-vision", type=Path, help="keep phase 1's tower and probe here")
    parser.add_argument("--vision-from", type=Path, help="skip phase 1: start from a --save-vision file")
    parser.add_argument("--save-answers", type=Path, help="keep phase 2's model here")
    parser.add_argument("--answers-from", type=Path, help="skip phases 1 and 2: start from a --save-answers file or a checkpoint")
    parser.add_argument("--json-from", type=Path, help="skip phases 1 to 3: start from a checkpoint that answers JSON")
    for name, value in asdict(Recipe()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args())
    out, log_every = args.pop("out"), args.pop("log_every")
    shortcuts = {name: args.pop(name) for name in ("vision_from", "save_vision", "answers_from", "save_answers", "json_from")}
    recipe = Recipe(**args)
    print(json.dumps(asdict(recipe)))
    print(train(recipe, out, log_every, **shortcuts))


if __name__ == "__main__":
    main()
