"""A batch the device has no memory for is encoded as halves, each split
again if it must be (vision_encoder/work.py, encode_splitting): the tokens
are those of the images encoded apart, and one image that does not fit alone
fails with the out-of-memory error. The error is the encoder's test hook
(`encoder.test_oom_above_rows`, vision_encoder/towers/tower.py OutOfMemoryAbove),
raised as torch raises it on a GPU; bench.gpu_encoder does the same on a
GPU with the process's memory limited."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from vision_encoder.batcher import Job
from vision_encoder.towers.tower import OutOfMemoryAbove, TowerImage
from vision_encoder.towers import load_tower
from vision_encoder.work import StageTimes, encode_splitting, prepare_into

SIZES = [(224, 224), (280, 224), (224, 336), (252, 252), (308, 224)]  # 256 to 440 patches each


@pytest.fixture(scope="module")
def tower():
    return load_tower(str(ensure_demo_model(RANDOM_MODEL)), "float32", "cpu")


def jobs_of(tower) -> list[Job]:
    rng = np.random.default_rng(0)
    images = [TowerImage(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), (h, w)) for h, w in SIZES]
    return [Job(bytes([i]), image, tower.num_patches(*image.pixels.shape[:2]), 0.0) for i, image in enumerate(images)]


def test_a_batch_over_the_memory_is_encoded_in_parts_with_the_same_tokens(tower):
    jobs = jobs_of(tower)
    apart = [tower.encode(tower.preprocess([job.image]))[0] for job in jobs]
    limited = OutOfMemoryAbove(tower, rows=900)  # two small images fit, three do not
    times = StageTimes()
    together = encode_splitting(limited, jobs, [limited.preprocess([job.image for job in jobs])], times)
    assert times.oom_splits >= 2  # 5 → 2 + 3 → ... : more than one split
    assert [grid for _, grid in together] == [grid for _, grid in apart]
    for (got, _), (expected, _) in zip(together, apart):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_one_image_that_does_not_fit_alone_is_none_and_the_rest_of_its_batch_is_encoded(tower):
    """It used to fail its whole batch: every other request in it got a 503 and failed over."""
    rng = np.random.default_rng(1)
    large = TowerImage(rng.integers(0, 255, (672, 672, 3), dtype=np.uint8), (672, 672))  # 2,304 patches
    jobs = jobs_of(tower)[:2]
    jobs.insert(1, Job(b"large", large, tower.num_patches(672, 672), 0.0))
    apart = [tower.encode(tower.preprocess([job.image]))[0] for job in jobs[::2]]
    limited = OutOfMemoryAbove(tower, rows=900)
    together = encode_splitting(limited, jobs, [limited.preprocess([job.image for job in jobs])], StageTimes())
    assert together[1] is None
    for (got, _), (expected, _) in zip(together[::2], apart):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert encode_splitting(limited, jobs[1:2], [], StageTimes()) == [None]


class FailsOnGrid:
    """The tower, except that a batch holding an image of `grid` fails (an error other than out of
    memory, in its preprocessing or its forward: what one malformed input could raise)."""

    def __init__(self, tower, grid: tuple[int, int, int], stage: str) -> None:
        self._tower, self._grid, self._stage = tower, list(grid), stage

    def __getattr__(self, name: str):
        return getattr(self._tower, name)

    def _check(self, batch) -> None:
        if self._grid in batch.grid_thw.tolist():
            raise RuntimeError(f"test hook: a kernel failed on grid {self._grid}")

    def preprocess(self, images):
        batch = self._tower.preprocess(images)
        if self._stage == "preprocess":
            self._check(batch)
        return batch

    def encode(self, batch):
        if self._stage == "encode":
            self._check(batch)
        return self._tower.encode(batch)


@pytest.mark.parametrize("stage", ["preprocess", "encode"])
def test_an_image_a_batch_fails_on_fails_alone_and_the_rest_of_its_batch_is_encoded(tower, stage):
    """An error other than out of memory failed the whole batch: every request that shared it got a
    500. The batch is split as for out of memory, until the image it fails on fails alone."""
    from vision_encoder.work import EncodeError, AtOnce, batch_stages

    rng = np.random.default_rng(2)
    bad = TowerImage(rng.integers(0, 255, (336, 336, 3), dtype=np.uint8), (336, 336))  # grid (1, 24, 24): its own
    jobs = jobs_of(tower)
    jobs.insert(2, Job(b"bad", bad, tower.num_patches(336, 336), 0.0))
    apart = [tower.encode(tower.preprocess([job.image]))[0] for job in jobs if job.key != b"bad"]
    failing = FailsOnGrid(tower, (1, 24, 24), stage)
    preprocess, vit = batch_stages(failing, jobs, AtOnce(), StageTimes())
    box: list = []
    prepare_into(box, preprocess)
    encoded = vit(box)
    assert isinstance(encoded[2], EncodeError) and "failed on grid" in encoded[2].message
    for (got, _), (expected, _) in zip(encoded[:2] + encoded[3:], apart):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


class AlwaysFails:
    """A tower whose every forward fails: an error that is no one image's."""

    def __init__(self) -> None:
        self.encodes = 0

    def preprocess(self, images):
        return _Inputs(len(images))

    def encode(self, inputs):
        self.encodes += 1
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    def device_lost(self) -> bool:
        return False


def test_an_error_that_is_no_one_image_s_fails_the_batch_in_a_few_attempts(monkeypatch):
    """Split until one image fails alone, a batch of 16 took 31 attempts (5 times its work) to fail
    every image; a first half of several that fails whole says the error is not one image's."""
    from vision_encoder import work

    monkeypatch.setattr(work, "prepare", lambda tower, jobs: tower.preprocess([job.image for job in jobs]))
    tower = AlwaysFails()
    results = work.encode_splitting(tower, [Job(bytes([i]), None, 10, 0.0) for i in range(16)], [], StageTimes())
    assert len(results) == 16 and all(isinstance(result, work.EncodeError) for result in results)
    assert tower.encodes == 6  # 16, 8, 4, 2, then each of the last 2's halves


@pytest.mark.parametrize("lost", [True, False])
def test_a_device_error_is_raised_where_the_device_is_lost_and_split_like_any_other_where_not(monkeypatch, lost):
    from vision_encoder import work

    class DeviceError(AlwaysFails):
        def encode(self, inputs):
            if inputs.count > 1 or not lost:
                raise torch.AcceleratorError("CUDA error: invalid configuration argument")
            return [(torch.zeros(2, 4), (1, 1, 2))]

        def device_lost(self) -> bool:
            return lost

    monkeypatch.setattr(work, "prepare", lambda tower, jobs: tower.preprocess([job.image for job in jobs]))
    jobs = [Job(bytes([i]), None, 10, 0.0) for i in range(4)]
    if lost:
        with pytest.raises(torch.AcceleratorError):
            work.encode_splitting(DeviceError(), jobs, [], StageTimes())
    else:
        assert all(isinstance(result, work.EncodeError) for result in work.encode_splitting(DeviceError(), jobs, [], StageTimes()))


def test_each_image_of_a_batch_comes_out_on_memory_of_its_own(tower):
    """What the cache keeps: a view into the batch's buffer would hold all of it (cache.owning)."""
    from vision_encoder.work import AtOnce, batch_stages

    preprocess, vit = batch_stages(tower, jobs_of(tower), AtOnce(), StageTimes())
    encoded = vit([preprocess()])
    assert len(encoded) == len(SIZES)
    assert all(tensor.untyped_storage().nbytes() == tensor.nbytes for tensor, _ in encoded)


def test_preprocessing_that_runs_out_of_memory_is_left_to_the_splitting_path():
    """A batch's preprocessing on the GPU can run out of memory ahead of its ViT: None, and
    encode_splitting prepares it again in parts. Its traceback, which holds the attempt's tensors, goes."""
    from vision_encoder.work import prepared_or_none

    raised = []

    def out_of_memory():
        error = torch.OutOfMemoryError("CUDA out of memory")
        raised.append(error)
        raise error

    assert prepared_or_none(out_of_memory) is None and raised[0].__traceback__ is None
    assert prepared_or_none(lambda: "inputs") == "inputs"


class _Inputs:
    """A preprocessed batch whose lifetime the test can see."""

    def __init__(self, count: int) -> None:
        self.count = count


class _OutOfMemoryPastOne:
    """A tower that has memory for one image at a time, and notes whether the whole batch's
    preprocessed inputs were still alive at each encode."""

    def __init__(self) -> None:
        self.whole_alive_at: list[bool] = []
        self.whole = None

    def preprocess(self, images):
        return _Inputs(len(images))

    def encode(self, inputs):
        gc.collect()
        self.whole_alive_at.append(self.whole() is not None)
        if inputs.count > 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return [(torch.zeros(2, 4), (1, 1, 2))]

    def release_memory(self) -> None:
        pass


@pytest.mark.parametrize("lane", ["main", "express"])
def test_a_split_runs_without_the_whole_batch_s_inputs(lane, monkeypatch):
    """On a GPU the whole batch's pixel values hold device memory its parts need: once it failed, it goes."""
    from concurrent.futures import ThreadPoolExecutor

    from vision_encoder import work

    tower = _OutOfMemoryPastOne()
    monkeypatch.setattr(work, "prepare", lambda tower, jobs: tower.preprocess([job.image for job in jobs]))
    jobs = [Job(bytes([i]), None, 10, 0.0) for i in range(4)]
    times = StageTimes()
    preprocess, vit = work.batch_stages(tower, jobs, work.AtOnce(), times)

    def watched_preprocess():
        inputs = preprocess()
        tower.whole = weakref.ref(inputs)
        return inputs

    if lane == "main":
        with ThreadPoolExecutor(1) as other_thread:
            box: list = []
            preprocessed = other_thread.submit(work.prepare_into, box, watched_preprocess)
            encoded = work.vit_after(preprocessed, box, vit)
    else:
        encoded = work.both_stages(watched_preprocess, vit)
    assert len(encoded) == 4 and times.oom_splits == 3
    assert tower.whole_alive_at[0] and not any(tower.whole_alive_at[1:])


class _OutOfMemoryThenBroken:
    """Memory for one image at a time; the last image then meets a device fault (not split: the
    service judges whether the device is lost)."""

    def __init__(self) -> None:
        self.encoded = 0

    def preprocess(self, images):
        return _Inputs(len(images))

    def encode(self, inputs):
        if inputs.count > 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        self.encoded += 1
        if self.encoded == 4:
            raise torch.AcceleratorError("device fault")
        return [(torch.zeros(2, 4), (1, 1, 2))]

    def release_memory(self) -> None:
        pass

    def device_lost(self) -> bool:
        return True


def test_the_splits_of_a_batch_that_then_fails_are_still_counted(monkeypatch):
    """The batch fails its requests, but it was split for want of memory first: the
    encoder's `oom_splits` counts that (the stage's times outlive its failure)."""
    from vision_encoder import work

    tower = _OutOfMemoryThenBroken()
    monkeypatch.setattr(work, "prepare", lambda tower, jobs: tower.preprocess([job.image for job in jobs]))
    jobs = [Job(bytes([i]), None, 10, 0.0) for i in range(4)]
    times = StageTimes()
    preprocess, vit = work.batch_stages(tower, jobs, work.AtOnce(), times)
    with pytest.raises(torch.AcceleratorError, match="device fault"):
        vit([preprocess()])
    assert times.oom_splits == 3  # the batch, then each half
