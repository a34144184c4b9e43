"""Run parameter-server configurations several times and tabulate final accuracy and staleness.

Each run is a real ``run_parameter_server_training.py`` job (server and worker processes, gRPC)
writing under ``--out`` (never the repository); the table is built from each run's summary JSON and
the server's ``events.jsonl`` (staleness histogram of the pushes). Async runs are timing-dependent,
so every configuration runs ``--repeats`` times and the table gives mean, min and max.

A configuration is a name and the runner's flags. ``--slow-worker F`` runs the server and workers
as separate roles (the same runner, ``--role server`` / ``--role worker``) so that worker 0 can be
slowed for real: it is stopped (SIGSTOP) and continued (SIGCONT) in a duty cycle that leaves it a
fraction 1/F of the time (F=3: stopped 2/3 of every 60 ms).

    python scripts/async_study.py --out /tmp/study --repeats 3 \\
        --config "sync2=--workers 2 --aggregation-mode sync" \\
        --config "async2=--workers 2 --aggregation-mode async"
    python scripts/async_study.py --out /tmp/study --preset mnist_5k --repeats 3 > table.md

Prints a Markdown table; ``<out>/results.json`` keeps every run's figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from src.studies.async_study import run_study, study_configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for every run's logs and checkpoints (not the repo)")
    parser.add_argument(
        "--config", action="append", default=[], metavar="NAME=FLAGS", help="a configuration, repeatable"
    )
    parser.add_argument(
        "--preset", help="the spec's commands on this dataset (mnist_5k, mnist), sync and async, N=2 and 4"
    )
    parser.add_argument("--extra", default="", help="flags added to every preset configuration")
    parser.add_argument("--only", help="run only preset configurations whose name starts with this (sync, async)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow-worker", type=float, default=1.0, metavar="F", help="slow worker 0 F times (F > 1)")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    configs = study_configs(args.config, args.preset, args.extra, args.only)
    if not configs:
        parser.error("give --config NAME=FLAGS or --preset DATASET")
    table = run_study(
        configs,
        Path(args.out),
        repeats=args.repeats,
        slow_factor=args.slow_worker,
        timeout_s=args.timeout_s,
        progress=sys.stderr,
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
