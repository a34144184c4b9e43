"""In-process simulation of asynchronous parameter-server training, for exploring corrections fast.

The simulation is :mod:`src.studies.async_simulation` (N virtual workers on a virtual clock, the server's
optimizer, the same shards, compression and error feedback as a real run); this is its command line,
``--repeats`` runs with the schedule seeded 0, 1, ... (``uniform`` is a harsh round robin,
``exponential`` memoryless staleness, ``--slowdown`` a slow worker). Prints each run's JSON
(accuracy, staleness histogram, train-loss trace per 16 pushes) on stderr and the summary on stdout.

    python scripts/async_sim.py --workers 2 --correction none --compression topk --repeats 3
    python scripts/async_sim.py --workers 4 --correction lookahead --compression topk --schedule exponential
    python scripts/async_sim.py --workers 4 --variant '{"lr_scale": 0.25, "own": false}'
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from src.studies.async_simulation import simulate_repeats, simulation_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dataset", default="mnist_5k")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--compression", choices=("topk", "quantization"))
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--staleness-policy", default="none")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--max-staleness", type=int, default=8)
    parser.add_argument("--system", default="{}", help="extra system fields as JSON (e.g. the correction)")
    parser.add_argument("--schedule", choices=("uniform", "exponential"), default="uniform")
    parser.add_argument("--jitter", type=float, default=0.2)
    parser.add_argument("--slowdown", type=float, default=1.0, help="worker 0 takes this many times longer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--correction",
        choices=("none", "implicit_momentum", "lookahead"),
        default="lookahead",
        help="system.async_correction",
    )
    parser.add_argument("--variant", default="", help="JSON: a MomentumVariant instead of the server's optimizer")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = simulation_config(
        workers=args.workers,
        dataset=args.dataset,
        epochs=args.epochs,
        lr=args.lr,
        momentum=args.momentum,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        compression=args.compression,
        ratio=args.ratio,
        staleness_policy=args.staleness_policy,
        beta=args.beta,
        max_staleness=args.max_staleness,
        correction=args.correction,
        system=json.loads(args.system),
    )
    summary = simulate_repeats(
        config,
        repeats=args.repeats,
        schedule=args.schedule,
        jitter=args.jitter,
        slowdown=args.slowdown,
        variant=json.loads(args.variant) if args.variant else None,
        progress=sys.stderr,
    )
    print(json.dumps({"args": vars(args), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
