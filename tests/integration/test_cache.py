"""The visual-token cache: a repeat skips encoding; other preprocessing, other
entry; concurrent requests for one new image share one encode."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from cache import content_key
from prism.demo_model import RANDOM_MODEL, write_demo_model
from loadtest.synthetic import make_image
from tests.integration.cases import data_url
from tests.integration.conftest import MODEL_NAME
from tests.integration.corpus import b64, save
from tests.integration.encoder_socket import encoder_stats
from tests.integration.helpers import scrape, stages
from vision_encoder.towers import load_tower


def ask_about(client, url: str, max_tokens: int = 4):
    return client.chat.completions.create(
        model=MODEL_NAME, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}],
    )


def test_second_request_with_the_same_image_is_a_hit_without_encoding(client, tmp_path):
    path = tmp_path / "fresh.png"
    make_image("cache-test-fresh", (300, 200)).save(path)
    first, second = ask_about(client, data_url(path)), ask_about(client, data_url(path))
    assert first.model_extra["prism"]["cache"] == {"hits": 0, "misses": 1}
    assert second.model_extra["prism"]["cache"] == {"hits": 1, "misses": 0}
    assert stages(first)["encode"] > 0
    assert stages(second)["encode"] == 0 and stages(second)["encode_queue"] == 0
    assert second.choices[0].message.content == first.choices[0].message.content


def test_same_bytes_under_other_preprocessing_are_other_entries():
    digest = b"\x01" * 16  # the gateway's digest of one image's bytes
    default = load_tower(str(RANDOM_MODEL), "float32", "cpu")
    smaller = load_tower(str(RANDOM_MODEL), "float32", "cpu", max_pixels=200704)
    bf16 = load_tower(str(RANDOM_MODEL), "bfloat16", "cpu")
    keys = {content_key(t.fingerprint, digest) for t in (default, smaller, bf16)}
    assert len(keys) == 3
    assert smaller.processor_info.max_pixels == 200704 != default.processor_info.max_pixels


def test_retrained_weights_of_the_same_shapes_are_other_entries(tmp_path):
    # Same path, same config, same file sizes: only the weights' bytes differ.
    fingerprints = []
    for seed in (1, 2, 1):
        write_demo_model(tmp_path / "retrained", seed=seed)
        fingerprints.append(load_tower(str(tmp_path / "retrained"), "float32", "cpu").fingerprint)
    assert fingerprints[0] != fingerprints[1] and fingerprints[0] == fingerprints[2]


def lookup_counts(stack) -> tuple[float, float, float, float, float]:
    """The encoders' cache hits, misses and joins and images encoded, asked of
    them (current, where the gateway's scrape lags a stats poll), and images
    the gateway sent by a reference it kept (no encoder asked)."""
    encoders = [encoder_stats(address) for address in stack.encoder_addresses]
    counts = [sum(getattr(e, field) for e in encoders) for field in ("cache_hits", "cache_misses", "cache_joins", "images_encoded")]
    return (*counts, scrape(stack)[("prism_gateway_images_by_known_reference_total", ())])


def test_sixteen_concurrent_requests_for_one_new_image_encode_it_once(stack, client):
    url = b64(save(make_image("dedup-16", (800, 600)), "JPEG"), "image/jpeg")
    before = lookup_counts(stack)
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: ask_about(client, url, max_tokens=2), range(16)))
    assert len({r.choices[0].message.content for r in responses}) == 1
    hits, misses, joins, encoded, known = (after - earlier for after, earlier in zip(lookup_counts(stack), before))
    # Every request counted one lookup (at an encoder, or a reference the
    # gateway kept from the first answer), and exactly one encode ran: the
    # other requests joined it (queued or running) or found it cached.
    assert hits + misses + known == 16, (hits, misses, known)
    assert encoded == 1, (hits, misses, joins, encoded)
    assert joins + hits + known >= 1
