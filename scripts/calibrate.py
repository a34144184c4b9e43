r"""Measure the cost-model figures of a virtual-time run on this machine, and print them as config lines.

    python scripts/calibrate.py --config configs/ps_sync_mnist.yaml
    python scripts/calibrate.py --config configs/experiments/virtual_ps_vs_ddp.yaml \
        --set system.compression_enabled=true
    python scripts/calibrate.py --model simple_cnn --dataset mnist_5k --batch-size 64 --concurrent 3
    python scripts/calibrate.py --config CONFIG --json      # one JSON object instead of YAML
    python scripts/calibrate.py --model simple_cnn --batch-size 256 --layers   # each layer's share, measured and proxy

Paste the printed ``emulation:`` lines into the config of a ``--clock virtual`` run (or pass them as
``--compute-s`` etc.). What each figure is and how it is measured: src/virtual/calibration.py. ``--concurrent N``
measures compute in N processes at once, as N workers sharing this machine's cores would see it.
"""

from __future__ import annotations

import argparse
import json
import sys


def _assignment(text: str):
    from src.launch.cli import parse_assignment

    return parse_assignment(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the run's YAML/JSON config (model, dataset, batch, compression)")
    parser.add_argument("--model", dest="model_architecture", help="training.model_architecture")
    parser.add_argument("--dataset", help="training.dataset")
    parser.add_argument("--batch-size", type=int, help="training.batch_size")
    parser.add_argument("--concurrent", type=int, default=1, help="processes computing at once (default 1)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps and pushes per figure (default 20)")
    parser.add_argument("--no-server", action="store_true", help="only the worker's figures (DDP runs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--layers",
        action="store_true",
        help="only each layer's share of a step (forward, backward), measured beside the streamed virtual run's proxy",
    )
    parser.add_argument(
        "--set",
        dest="assignments",
        action="append",
        type=_assignment,
        metavar="FIELD=VALUE",
        help="set any config field, repeatable (e.g. --set system.compression_enabled=true)",
    )
    args = parser.parse_args(argv)
    if args.concurrent < 1 or args.steps < 1:
        parser.error("--concurrent and --steps must be >= 1")

    from src.config import ConfigError
    from src.launch.cli import exit_status
    from src.virtual.calibration import as_yaml, calibrate, calibration_config, measure_layers

    overrides = {f"training.{name}": getattr(args, name) for name in ("model_architecture", "dataset", "batch_size")}
    try:
        config = calibration_config(args.config, overrides=overrides, assignments=dict(args.assignments or []))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2

    def run() -> None:
        if args.layers:
            print(json.dumps(measure_layers(config, steps=args.steps)))
            return
        result = calibrate(config, concurrent=args.concurrent, steps=args.steps, server=not args.no_server)
        print(json.dumps(result) if args.json else as_yaml(result, config, args.config))

    return exit_status(run, describe={})


if __name__ == "__main__":
    sys.exit(main())
