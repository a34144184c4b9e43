"""Datasets (bundled mnist_5k, synthetic, torchvision idx files) and sharding properties."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from src.training.data import (
    BUNDLED_MNIST_5K,
    DatasetUnavailableError,
    epoch_permutation,
    load_dataset,
    make_shards,
    steps_per_epoch,
)


def test_mnist_5k_is_bundled_small_balanced_and_split():
    assert BUNDLED_MNIST_5K.stat().st_size < 1_000_000
    train = load_dataset("mnist_5k", "train")
    test = load_dataset("mnist_5k", "test")
    assert (len(train), len(test)) == (4000, 1000)
    assert train.images.shape == (4000, 1, 28, 28) and train.images.dtype == torch.float32
    assert torch.bincount(train.labels, minlength=10).tolist() == [400] * 10
    assert torch.bincount(test.labels, minlength=10).tolist() == [100] * 10
    with np.load(BUNDLED_MNIST_5K) as arrays:
        assert arrays["train_images"].dtype == np.uint8
        train_rows = {row.tobytes() for row in arrays["train_images"]}
        assert not any(row.tobytes() in train_rows for row in arrays["test_images"])  # held out


def test_max_samples_takes_a_prefix():
    full = load_dataset("mnist_5k", "train")
    small = load_dataset("mnist_5k", "train", max_samples=100)
    assert len(small) == 100
    assert torch.equal(small.images, full.images[:100])


def test_synthetic_is_seeded_and_sized():
    a = load_dataset("synthetic", "train", num_samples=300, seed=3)
    b = load_dataset("synthetic", "train", num_samples=300, seed=3)
    c = load_dataset("synthetic", "train", num_samples=300, seed=4)
    test = load_dataset("synthetic", "test", num_samples=300, seed=3)
    assert len(a) == 300 and len(test) == 75
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert not torch.equal(a.images[:75], test.images)


def _write_idx(folder, prefix, images, labels):
    folder.mkdir(parents=True, exist_ok=True)
    count, height, width = images.shape
    (folder / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 2051, count, height, width) + images.tobytes()
    )
    (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels.tobytes())


@pytest.mark.parametrize(("name", "folder"), [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_torchvision_idx_layout_is_read(tmp_path, name, folder):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(12, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=12, dtype=np.uint8)
    _write_idx(tmp_path / folder / "raw", "t10k", images, labels)
    test = load_dataset(name, "test", data_dir=str(tmp_path), download=False)
    assert len(test) == 12
    assert test.labels.tolist() == labels.tolist()
    info = test.info
    expected = (torch.from_numpy(images).float() / 255 - info.mean[0]) / info.std[0]
    torch.testing.assert_close(test.images[:, 0], expected)


def test_missing_dataset_says_where_and_suggests_mnist_5k(tmp_path):
    with pytest.raises(DatasetUnavailableError) as caught:
        load_dataset("mnist", "test", data_dir=str(tmp_path), download=False)
    message = str(caught.value)
    assert str(tmp_path / "MNIST" / "raw") in message and "mnist_5k" in message


def test_unknown_dataset_and_split():
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet", "train")
    with pytest.raises(ValueError, match="split must be"):
        load_dataset("mnist_5k", "validation")


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(0, 500), num_workers=st.integers(1, 9), epoch=st.integers(0, 5), seed=st.integers(0, 1000)
)
def test_shards_are_disjoint_covering_balanced_and_deterministic(num_samples, num_workers, epoch, seed):
    shards = make_shards(num_samples, num_workers, epoch, seed)
    assert [s.owner for s in shards] == list(range(num_workers))
    assert all(s.epoch == epoch for s in shards)
    everything = [i for s in shards for i in s.indices]
    assert sorted(everything) == list(range(num_samples))  # disjoint and covering
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= (1 if num_samples else 0)
    assert shards == make_shards(num_samples, num_workers, epoch, seed)


def test_epochs_and_seeds_reshuffle():
    assert epoch_permutation(100, 0, 0) != epoch_permutation(100, 1, 0)
    assert epoch_permutation(100, 0, 0) != epoch_permutation(100, 0, 1)


@settings(max_examples=60, deadline=None)
@given(num_samples=st.integers(1, 400), num_workers=st.integers(1, 6), batch=st.integers(1, 40))
def test_step_i_of_all_workers_is_step_i_of_one_big_batch(num_samples, num_workers, batch):
    """What makes sync PS / DDP equal to single-process SGD with batch N*b."""
    order = epoch_permutation(num_samples, 2, 7)
    per_worker = [list(s.batches(batch)) for s in make_shards(num_samples, num_workers, 2, 7)]
    num_steps = steps_per_epoch(num_samples, num_workers, batch)
    assert num_steps == max(len(b) for b in per_worker)
    big = batch * num_workers
    for step in range(num_steps):
        together = [i for batches in per_worker if step < len(batches) for i in batches[step]]
        assert sorted(together) == sorted(order[step * big : (step + 1) * big])
