"""The other model families, each token-for-token equal to vLLM given the raw
images (in-process, float32; past a token where vLLM's own top two tied, the
answers may part: cases.matches_reference), on a tiny random-weights checkpoint of the
family's own structure built at test time (prism/tiny_models.py).

Qwen2.5-VL: windowed attention blocks with full-attention ones between, as
its 7B checkpoint has.

Qwen3-VL: its embeddings carry the merger's tokens and each DeepStack
layer's feature side by side; vLLM adds the DeepStack part into the first
LLM layers, so an answer that matches shows both parts arrived intact.

LLaVA-OneVision and LLaVA-NeXT: each image is tiled at its best grid pinpoint; the gateway
sends the encoder pixels no larger than the tiles hold and the original size,
by which the encoder unpads the features as vLLM does on the raw image. Its
images' token lists differ in length, which vLLM's own schema refused within
one batch (llm_engine/vllm_site/prism_embedding_shapes.py): the concurrent
test batches different sizes together.

InternVL3: the grid of tiles closest to the image's aspect ratio, plus a
thumbnail; the gateway sends the image no larger than covers that canvas and
the encoder holds the processor to the original's tile count.

Videos (Qwen2.5-VL and Qwen3-VL; the demo model's Qwen2-VL in
test_video_serving.py): the same stack against vLLM's raw-video path as its
server runs it (each family's loader, the test pixel budget as
`mm_processor_kwargs`, which vLLM applies to videos too), answered by the
image reference's engine (reference_video_vllm.family_video_references).
"""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from openai import OpenAI

from cache import content_key
from loadtest.clips import make_clip
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import LocalStack
from prism.tiny_models import ensure_tiny_model
from protocol.to_gateway import GenerateFailed, TokenDelta
from vision_encoder.towers import load_tower
from testing.video_clips import CONCURRENT_CLIPS, ONE_FRAME_FILE
from tests.integration.cases import FAMILY_CASES, FAMILY_CONCURRENT_IMAGES, PARITY_IMAGES, TEST_MAX_PIXELS, data_url, matches_reference
from tests.integration.conftest import MODEL_NAME, ONE_PROCESS_ENGINE, STACK_OVERRIDES, session_stack
from tests.integration.prestart import Reference
from tests.integration.helpers import ask, embeddings_request, metric_total, send_raw
from tests.integration.reference_video_vllm import FAMILY_CLIPS, SERVED_CLIPS, MAX_TOKENS, MIXED_IMAGE, MIXED_VIDEOS, QUESTION

FAMILIES = ["qwen2.5-vl", "qwen3-vl", "llava-onevision", "llava-next", "internvl3"]
# The encoder's pixel budget is Qwen's; the families that tile images their own way refuse one at start-up.
NO_PIXEL_BUDGET = {k: v for k, v in STACK_OVERRIDES.items() if k not in ("PRISM_ENCODER__MAX_PIXELS", "PRISM_ENCODER__MIN_PIXELS")}
# Qwen3-VL runs with vLLM's tower loaded, under a per-prompt image limit of the engine's own: set below the gateway's here.
ENGINE_MAX_IMAGES = 4
QWEN3_VL_OVERRIDES = STACK_OVERRIDES | {"PRISM_ENGINE__MAX_IMAGES_PER_PROMPT": str(ENGINE_MAX_IMAGES)}
OVERRIDES = {"qwen2.5-vl": STACK_OVERRIDES, "qwen3-vl": QWEN3_VL_OVERRIDES, "llava-onevision": NO_PIXEL_BUDGET, "llava-next": NO_PIXEL_BUDGET, "internvl3": NO_PIXEL_BUDGET}
# (width the family's embeddings must have, a wrong one, the grid sent with them)
VIDEO_FAMILIES = {"qwen2.5-vl", "qwen3-vl"}
WIDTHS = {"qwen2.5-vl": (128, 64, (1, 4, 4)), "qwen3-vl": (384, 128, (1, 4, 4)), "llava-onevision": (128, 64, None), "llava-next": (128, 64, None), "internvl3": (128, 64, None)}


_REFERENCES = pytest.StashKey[dict[str, Reference]]()


def family_reference(config: pytest.Config, name: str) -> Reference:
    """The family's vLLM reference run, queued once (tests/integration/prestart.py)."""
    references = config.stash.setdefault(_REFERENCES, {})
    if name not in references:
        session = session_stack(config)
        run_dir = session.tmp.mktemp(f"{name}-reference")
        references[name] = session.runner.queue(Reference(
            run_dir / "reference.json", session.image_dir, run_dir / "reference.log", ensure_tiny_model(name),
            videos=name in VIDEO_FAMILIES, cases=FAMILY_CASES))
    return references[name]


def prestart(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The references of the families collected, queued while the unit tests run."""
    names = {item.callspec.params["family"] for item in items if "family" in getattr(getattr(item, "callspec", None), "params", {})}
    for name in FAMILIES:
        if name in names:
            family_reference(config, name)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    checkpoint = ensure_tiny_model(request.param)
    reference = family_reference(request.config, request.param)
    with LocalStack(tmp_path_factory.mktemp(request.param), OVERRIDES[request.param] | ONE_PROCESS_ENGINE, model=checkpoint) as stack:
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, reference, stack, request.param


def test_the_parity_images_include_a_strip_and_images_over_the_budget():
    assert {"strip", "portrait"} <= set(PARITY_IMAGES)
    assert sum(w * h > TEST_MAX_PIXELS for w, h in PARITY_IMAGES.values()) >= 2


@pytest.mark.parametrize("name", list(PARITY_IMAGES))
def test_single_image_matches_vllm(family, images, name):
    client, reference, _, _ = family
    response = ask(client, f"image-{name}", images)
    expected = reference[f"image-{name}"]
    assert matches_reference(response.choices[0].message.content, expected), (response.choices[0].message.content, expected["text"])
    assert response.usage.prompt_tokens == expected["prompt_tokens"]  # the same visual token count


def test_two_images_and_a_second_turn_match_vllm(family, images):
    client, reference, _, _ = family
    for case in ("two-images", "two-turns"):
        text = ask(client, case, images).choices[0].message.content
        assert matches_reference(text, reference[case]), (case, text, reference[case]["text"])


def test_eight_concurrent_requests_each_match_vllm(family, images):
    client, reference, _, _ = family
    names = FAMILY_CONCURRENT_IMAGES
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: ask(client, f"image-{n}", images).choices[0].message.content, names))
    want = [reference[f"image-{n}"] for n in names]
    assert all(matches_reference(text, expected) for text, expected in zip(got, want)), (got, [w["text"] for w in want])
    assert len({w["text"] for w in want}) > 1  # the answers differ, so a mix-up would show


def test_the_checkpoint_s_generation_defaults_apply(family, client):
    """The tiny checkpoints' generation_config.json sets top_k 1: sampled answers no longer depend on the seed.
    The demo checkpoint (`client`) sets no top_k, and there they do."""
    family_client, _, _, _ = family

    def story(through: OpenAI, seed: int) -> str:
        messages = [{"role": "user", "content": "Write a story."}]
        return through.chat.completions.create(model="prism-demo", messages=messages, max_tokens=12, temperature=1.0, seed=seed).choices[0].message.content

    assert story(family_client, 1) == story(family_client, 2) == story(family_client, 3)
    assert len({story(client, seed) for seed in (1, 2, 3)}) > 1


def test_two_families_given_the_same_image_never_share_a_cache_entry():
    towers = [load_tower(str(ensure_demo_model(RANDOM_MODEL)), "float32", "cpu")]
    towers += [load_tower(str(ensure_tiny_model(name)), "float32", "cpu") for name in FAMILIES]
    digest = bytes(range(16))  # one image, as the gateway digests it
    assert len({content_key(tower.fingerprint, digest) for tower in towers}) == len(towers)
    assert len({tower.family.name for tower in towers}) == len(towers)


def test_embeddings_of_the_wrong_width_are_refused_and_the_engine_lives(family):
    """Qwen3-VL without its DeepStack part: vLLM's engine core would die on it (EngineDeadError for
    every request after); the engine refuses that request alone. The same for a LLaVA-OneVision
    embedding narrower than the language model."""
    client, _, stack, name = family
    width, wrong, grid = WIDTHS[name]
    address = stack.engine_addresses[0]
    bad = asyncio.run(send_raw(address, *embeddings_request("wrong-width", torch.randn(4, wrong), grid)))
    assert isinstance(bad, GenerateFailed) and bad.status == 400 and f"expected (4, {width})" in bad.message
    good = asyncio.run(send_raw(address, *embeddings_request("right-width", torch.randn(4, width), grid)))
    assert isinstance(good, TokenDelta) and good.completion_tokens == 2


@pytest.mark.parametrize("family", ["qwen3-vl"], indirect=True)
def test_more_images_than_the_engine_takes_are_refused_before_any_is_encoded(family, images):
    """The engine's limit (engine.max_images_per_prompt) reaches the gateway in the handshake: past it, a
    400 naming that key before any image is fetched or encoded, not the engine's refusal after both."""
    client, _, stack, _ = family

    before = metric_total(stack, "prism_encoder_replica_requests_total")
    image = {"type": "image_url", "image_url": {"url": data_url(images[MIXED_IMAGE])}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                       messages=[{"role": "user", "content": [image] * (ENGINE_MAX_IMAGES + 1)}])
    assert f"the limit is {ENGINE_MAX_IMAGES} (engine.max_images_per_prompt)" in refused.value.message, refused.value.message
    assert metric_total(stack, "prism_encoder_replica_requests_total") == before


@pytest.fixture
def video_family(family):
    """The family's stack, for the tests marked `video_tests` (the families that take videos)."""
    return family


# The video tests run on the families that take videos only: the family fixture's own params, narrowed.
video_tests = pytest.mark.parametrize("family", [f for f in FAMILIES if f in VIDEO_FAMILIES], indirect=True)


def video_part(spec) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(make_clip(spec)).decode()}}


def ask_about(client: OpenAI, parts: list[dict]):
    return client.chat.completions.create(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0,
                                          messages=[{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}])


def assert_answers_as(response, expected: dict) -> None:
    text = response.choices[0].message.content
    assert matches_reference(text, expected), (text, expected["text"])
    assert response.usage.prompt_tokens == expected["prompt_tokens"]  # the same visual tokens, by grid and time axis
    if text == expected["text"]:
        assert response.usage.completion_tokens == len(expected["token_ids"])


@video_tests
@pytest.mark.parametrize("name", FAMILY_CLIPS)
def test_a_video_matches_vllm_s_raw_video_path(video_family, name):
    """Lengths, frame rates, sizes, portrait, an odd frame count, one over the pixel budget."""
    client, reference, _, _ = video_family
    assert_answers_as(ask_about(client, [video_part(SERVED_CLIPS[name])]), reference[f"video-{name}"])


@video_tests
def test_the_over_budget_clip_is_one_the_budget_shrinks_in_vllm(video_family):
    """The premise of the test above's over-budget case: in vLLM the clip has fewer prompt tokens
    under the budget than at the video processor's own size, so Prism matching it there shows
    Prism shrank it as vLLM does."""
    _, reference, _, _ = video_family
    assert reference["video-over-budget"]["prompt_tokens"] < reference["video-over-budget-unbudgeted"]["prompt_tokens"]


@video_tests
def test_a_one_frame_video_is_refused_as_vllm_refuses_it(video_family):
    client, reference, _, name = video_family
    assert reference["video-one-frame-file"]["refused"]
    with pytest.raises(openai.BadRequestError) as refused:
        ask_about(client, [video_part(ONE_FRAME_FILE)])
    assert "frame" in refused.value.message, refused.value.message


@video_tests
def test_two_videos_and_an_image_in_one_request_match_vllm(video_family, images):
    client, reference, _, _ = video_family
    image = {"type": "image_url", "image_url": {"url": data_url(images[MIXED_IMAGE])}}
    first, second = (video_part(SERVED_CLIPS[n]) for n in MIXED_VIDEOS)
    assert_answers_as(ask_about(client, [first, image, second]), reference["two-videos-and-an-image"])


@video_tests
def test_eight_concurrent_videos_of_mixed_lengths_each_match_vllm(video_family):
    client, reference, _, _ = video_family
    names = list(CONCURRENT_CLIPS)
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: ask_about(client, [video_part(SERVED_CLIPS[n])]), names))
    for name, response in zip(names, got):
        assert_answers_as(response, reference[f"video-{name}"])
    assert len({reference[f"video-{n}"]["prompt_tokens"] for n in names}) == len(names)  # mixed lengths: a mix-up would show


CONTEXT = 4096  # the stacks' engine.max_model_len (configs/cpu-demo.yaml)


def assert_counted_as_vllm_counts(client: OpenAI, part: dict) -> None:
    """The engine sets the output budget on the prompt vLLM runs, every placeholder expanded as
    vLLM expands it (InternVL's `<img>` `</img>` around an image's tokens, Qwen3-VL's timestamps
    between a video's frames): a prompt one token short of the context answers, one as long as
    the context is refused, as on vLLM's server, where a prompt that leaves no room is a 400."""
    def prompt_tokens(filler: int) -> int:
        text = {"type": "text", "text": "hi" + " a" * filler}
        return client.chat.completions.create(model=MODEL_NAME, max_tokens=1, temperature=0,
                                              messages=[{"role": "user", "content": [part, text]}]).usage.prompt_tokens

    base = prompt_tokens(0)
    assert prompt_tokens(8) == base + 8  # one token per " a"
    assert prompt_tokens(CONTEXT - 1 - base) == CONTEXT - 1
    with pytest.raises(openai.BadRequestError) as refused:
        prompt_tokens(CONTEXT - base)
    assert f"maximum context length is {CONTEXT} tokens; the prompt has {CONTEXT}" in refused.value.message, refused.value.message


def test_an_image_prompt_is_counted_as_vllm_counts_it(family, images):
    client, _, _, _ = family
    assert_counted_as_vllm_counts(client, {"type": "image_url", "image_url": {"url": data_url(images[MIXED_IMAGE])}})


@video_tests
def test_a_video_prompt_is_counted_as_vllm_counts_it(video_family):
    client, _, _, _ = video_family
    assert_counted_as_vllm_counts(client, video_part(SERVED_CLIPS[MIXED_VIDEOS[0]]))
