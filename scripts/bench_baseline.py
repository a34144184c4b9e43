"""Benchmark: the baseline trainer against a plain 20-line PyTorch loop, in one process.

Same model (simple_cnn), data (mnist_5k in memory), batch size, optimizer and thread count; both
read the same epoch permutations. Runs alternate (trainer, loop, trainer, loop, ...) so drift on a
noisy machine hits both; the median of each is compared. Evaluation and checkpointing are excluded
from the trainer's time; its logging, timing and progress bar are included.

    python scripts/bench_baseline.py [--epochs 2] [--repeats 3] [--batch-size 64]

Prints one JSON line: trainer and plain samples/s and their ratio (target >= 0.98).
"""

from __future__ import annotations

import argparse
import json
import sys

from src.benchmarks import baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    print(json.dumps(baseline.run_benchmark(args.epochs, args.repeats, args.batch_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
