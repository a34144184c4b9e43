"""Run every scripts/bench_*.py, keep each one's JSON, and table each figure beside its reference.

    python scripts/bench_all.py                              # all benchmarks, reports/bench.json (~5-8 min on 2 cores)
    python scripts/bench_all.py --quick                      # fewer repeats, smaller sizes (~2-3 min)
    python scripts/bench_all.py --only bench_compression bench_ps --output reports/bench.json
    python generate_performance_report.py --runs-dir artifacts --bench-json reports/bench.json

Benchmarks run one after another (never side by side: they time the same cores), each with a time
limit. reports/bench.json holds ``results`` (each script's JSON, its command, exit status and wall
time) and ``figures``: one row per figure with our value, the reference's (plain PyTorch loop,
plain DDP loop, raw gRPC echo, torch.topk, PowerSGD), the ratio, how the ratio is defined and the
target the benchmark states (``None`` where none is set). A benchmark that fails keeps its row with
the error, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from src.benchmarks import suite


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The flags, and the benchmarks to run (``--only`` checked against scripts/bench_*.py)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--output", default="reports/bench.json", help="where to write the results (default reports/bench.json)"
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these (e.g. bench_ps bench_compression)")
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats and smaller sizes: a smoke run, not for docs"
    )
    parser.add_argument("--timeout-s", type=float, default=900, help="limit per benchmark (default 900)")
    args = parser.parse_args(argv)
    names = suite.discover()
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"--only: no scripts/{unknown[0]}.py (known: {', '.join(names)})")
        names = [n for n in names if n in args.only]
    return args, names


def main(argv: list[str] | None = None) -> int:
    args, names = parse_args(argv)
    command = "python scripts/bench_all.py " + " ".join(argv if argv is not None else sys.argv[1:])
    document = suite.run_suite(names, args.quick, args.timeout_s, command)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    for line in suite.table_lines(document["figures"]):
        print(line)
    print(f"wrote {output}")
    return 1 if any(entry["error"] for entry in document["results"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
