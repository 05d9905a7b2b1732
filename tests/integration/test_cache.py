"""The visual-token cache: a repeat skips encoding; other preprocessing, other entry."""

from __future__ import annotations

from cache import content_key
from prism.config import REPO_ROOT
from prism.synthetic import make_image
from tests.integration.helpers import stages
from vision_encoder.tower import VisionTower

DEMO_MODEL = str(REPO_ROOT / "models" / "prism-demo-qwen2vl")


def test_second_request_with_the_same_image_is_a_hit_without_encoding(client, tmp_path):
    path = tmp_path / "fresh.png"
    make_image("cache-test-fresh", (300, 200)).save(path)
    from tests.integration.cases import data_url
    from tests.integration.conftest import MODEL_NAME

    def request():
        return client.chat.completions.create(
            model=MODEL_NAME, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(path)}}, {"type": "text", "text": "hi"}]}],
        )

    first, second = request(), request()
    assert first.model_extra["prism"]["cache"] == {"hits": 0, "misses": 1}
    assert second.model_extra["prism"]["cache"] == {"hits": 1, "misses": 0}
    assert stages(first)["encode"] > 0
    assert stages(second)["encode"] == 0 and stages(second)["encode_queue"] == 0
    assert second.choices[0].message.content == first.choices[0].message.content


def test_same_bytes_under_other_preprocessing_are_other_entries():
    digest = b"\x01" * 16  # the gateway's digest of one image's bytes
    default = VisionTower(DEMO_MODEL, "float32", "cpu")
    smaller = VisionTower(DEMO_MODEL, "float32", "cpu", max_pixels=200704)
    bf16 = VisionTower(DEMO_MODEL, "bfloat16", "cpu")
    keys = {content_key(t.fingerprint, digest) for t in (default, smaller, bf16)}
    assert len(keys) == 3
    assert smaller.processor_info.max_pixels == 200704 != default.processor_info.max_pixels
