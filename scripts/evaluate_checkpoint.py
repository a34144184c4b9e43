"""Evaluate any checkpoint (baseline, parameter server or DDP) on a dataset's test split.

    python scripts/evaluate_checkpoint.py --checkpoint checkpoints/test_baseline/baseline_final.pt \\
        --dataset mnist --data-dir ./data

Prints one JSON object: {"accuracy": ..., "loss": ..., "num_samples": ...}. With --dataset mnist the
files are read from torchvision's layout, <data-dir>/MNIST/raw/t10k-*-ubyte (see
scripts/fetch_official_mnist.py to write them offline).
"""

from __future__ import annotations

import argparse
import json
import sys

from src.common.checkpoint import CheckpointError
from src.config import DATASET_NAMES
from src.trainer import evaluate_checkpoint
from src.training.data import DatasetUnavailableError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint file in the common format")
    parser.add_argument("--dataset", choices=DATASET_NAMES, help="dataset to test on (default: the checkpoint's)")
    parser.add_argument("--data-dir", default="./data", help="torchvision root (default ./data)")
    parser.add_argument("--max-test-samples", type=int, help="evaluate on only the first N test samples")
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args(argv)
    try:
        result = evaluate_checkpoint(
            args.checkpoint,
            dataset=args.dataset,
            data_dir=args.data_dir,
            max_test_samples=args.max_test_samples,
            batch_size=args.batch_size,
        )
    except (CheckpointError, DatasetUnavailableError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
