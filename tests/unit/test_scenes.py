"""The synthetic scenes behind the trained demo model: seeded, self-consistent,
and drawn where their geometry says they are, at any resolution."""

from __future__ import annotations

import random

import numpy as np
import pytest

from prism import scenes


def test_same_seed_same_scenes_and_questions():
    def draw(seed):
        rng = random.Random(seed)
        scene = scenes.make_scene(rng)
        return scene, scenes.ask(scene, rng)

    assert draw("a") == draw("a")
    assert draw("a") != draw("b")


@pytest.mark.parametrize("seed", range(20))
def test_answers_follow_the_scene(seed):
    rng = random.Random(seed)
    scene = scenes.make_scene(rng)
    kinds = [s.kind for s in scene.shapes]
    assert len(set(kinds)) == len(kinds) and len({s.colour for s in scene.shapes}) == len(kinds)
    colour = scenes.ask(scene, rng, "colour")
    shape_named = next(s for s in scene.shapes if s.kind in colour.text)
    assert colour.answer == shape_named.colour
    shape = scenes.ask(scene, rng, "shape")
    assert shape.answer == next(s.kind for s in scene.shapes if s.colour in shape.text)
    assert scenes.ask(scene, rng, "count").answer == scenes.COUNT_WORDS[len(scene.shapes)]
    description = scenes.ask(scene, rng, "describe").answer
    assert all(f"{s.colour} {s.kind}" in description for s in scene.shapes)


@pytest.mark.parametrize("size", [(256, 256), (300, 180), (120, 240)])
def test_shapes_are_drawn_where_their_geometry_says(size):
    rng = random.Random(f"geometry-{size}")
    for _ in range(5):
        scene = scenes.make_scene(rng, aspect=size[0] / size[1])
        pixels = np.asarray(scene.render(*size)).astype(int)
        y, x = np.mgrid[0 : size[1], 0 : size[0]] + 0.5
        covered = scene.covering(x, y, *size)
        for index, shape in enumerate(scene.shapes, start=1):
            inside = covered == index
            assert inside.sum() > 50  # visible
            # Pixels the geometry puts inside the shape carry its colour (edges
            # may differ by the rasteriser's rounding).
            assert (np.abs(pixels[inside] - shape.rgb).max(axis=1) == 0).mean() > 0.95


def test_one_scene_at_two_resolutions_is_the_same_picture():
    scene = scenes.make_scene(random.Random("two-sizes"), aspect=1.0)
    small = np.asarray(scene.render(128, 128)).astype(int)
    large = np.asarray(scene.render(1024, 1024).resize((128, 128))).astype(int)
    assert np.abs(small - large).mean() < 12
