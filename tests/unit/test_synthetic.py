"""Synthetic images: one picture per name, the same one every time."""

import numpy as np

from loadtest.synthetic import make_image


def pixels(name: str) -> np.ndarray:
    return np.asarray(make_image(name, (64, 48)))


def test_names_with_the_same_characters_render_different_pictures():
    # profile-12 and profile-21 once rendered alike: benchmarks' "unique" images repeated
    names = ["profile-12", "profile-21", "profile-3", "profile-30", "load-19", "load-28", "load-91"]
    rendered = [pixels(name).tobytes() for name in names]
    assert len(set(rendered)) == len(names)


def test_a_name_renders_the_same_picture_every_time():
    assert np.array_equal(pixels("floor-4k-0"), pixels("floor-4k-0"))
