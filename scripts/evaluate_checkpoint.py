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

from src.checkpoint import CheckpointError, load_checkpoint
from src.config import DATASET_NAMES
from src.data import DatasetUnavailableError, dataset_info, load_dataset
from src.models import build_model
from src.trainer import evaluate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint file in the common format")
    parser.add_argument("--dataset", choices=DATASET_NAMES, help="dataset to test on (default: the checkpoint's)")
    parser.add_argument("--data-dir", default="./data", help="torchvision root (default ./data)")
    parser.add_argument("--max-test-samples", type=int, help="evaluate on only the first N test samples")
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args(argv)
    try:
        checkpoint = load_checkpoint(args.checkpoint)
        name = args.dataset or checkpoint["dataset"]
        info, trained_on = dataset_info(name), dataset_info(checkpoint["dataset"])
        if (info.channels, info.height, info.width, info.num_classes) != (
            trained_on.channels,
            trained_on.height,
            trained_on.width,
            trained_on.num_classes,
        ):
            raise ValueError(f"--dataset {name}: samples do not fit a model trained on {checkpoint['dataset']}")
        model = build_model(checkpoint["model_architecture"], trained_on)
        model.load_state_dict(checkpoint["model_state_dict"])
        synthetic = checkpoint["config"].get("training", {})
        test = load_dataset(
            name,
            "test",
            data_dir=args.data_dir,
            max_samples=args.max_test_samples,
            num_samples=synthetic.get("num_samples", 2048),
            seed=synthetic.get("seed", 0),
        )
    except (CheckpointError, DatasetUnavailableError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    loss, accuracy = evaluate(model, test, batch_size=args.batch_size)
    print(
        json.dumps(
            {
                "accuracy": accuracy,
                "loss": loss,
                "num_samples": len(test),
                "dataset": name,
                "checkpoint": str(args.checkpoint),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
