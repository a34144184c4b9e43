"""Baseline single-process training: the reference the distributed architectures are measured against.

    python run_baseline_training.py                                   # 2 epochs on bundled mnist_5k
    python run_baseline_training.py --dataset mnist --num-epochs 5    # torchvision MNIST under ./data
    python run_baseline_training.py --resume checkpoints/test_baseline --num-epochs 4
    python run_baseline_training.py --amp bf16                        # bfloat16 autocast, float32 weights

Outputs: checkpoints in checkpoints/test_baseline, TensorBoard logs + events.jsonl + summary.json in
logs/test_baseline (change with --checkpoint-dir / --log-dir / --summary-json); with --artifacts-dir DIR
also DIR/baseline.json and DIR/baseline_events.jsonl for generate_performance_report.py.
"""

from __future__ import annotations

import argparse
import sys

from src.launch.cli import (
    AMP_FLAGS,
    add_amp_flag,
    add_common_flags,
    config_from_args,
    exit_status,
    write_artifacts_if_asked,
)
from src.metrics import format_summary

DEFAULTS = {"system.checkpoint_dir": "checkpoints/test_baseline", "system.log_dir": "logs/test_baseline"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    add_amp_flag(parser)
    args = parser.parse_args(argv)
    config = config_from_args(
        args,
        defaults=DEFAULTS,
        extra_flags=AMP_FLAGS,
        forced={"system.architecture": "baseline", "system.num_workers": 1},
    )

    from src.trainer import BaselineTrainer  # torch import after flag checks keeps --help fast

    def run() -> None:
        summary = BaselineTrainer(config, resume=args.resume, summary_json=args.summary_json).run()
        print(format_summary(summary))
        write_artifacts_if_asked(args, config, summary)

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
