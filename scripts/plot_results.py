"""Plots and a Markdown table of finished experiment runs (:func:`src.reports.plots.write_results`).

    python scripts/plot_results.py --results results/matrix_smoke
    python scripts/plot_results.py --results results/f1 results/f8 --out results/plots

``--results`` takes run folders (holding ``summary.json``, from run_experiment.py) or folders of
them (a matrix, from run_matrix.py); unfinished runs are left out. Everything is read from the runs'
summaries and ``events.jsonl`` files (the source of truth). Written to ``--out`` (default: the
first results folder's ``plots/``):

| file | what |
|---|---|
| ``accuracy_vs_time.png`` | test accuracy against seconds of training (every evaluation) |
| ``accuracy_vs_bytes.png`` | test accuracy against the bytes the workers moved until then (sent + received) |
| ``time_to_target.png`` | time to target accuracy per configuration: mean, spread and each seed |
| ``bytes_per_run.png`` | bytes sent and received per run |
| ``staleness.png`` | staleness histograms of the async runs |
| ``controller.png`` | the adaptive controller's top-k fraction over time (its ``controller`` events) |
| ``results.md`` | a table of every run, and one per configuration over its seeds (mean ± std) |

A configuration is a run name without its ``seed-N`` part (run_matrix.py names runs that way).
"""

import argparse
import sys
from pathlib import Path

from src.reports.plots import write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", required=True, help="run folders or folders of runs")
    parser.add_argument("--out", help="output folder (default <first --results>/plots)")
    args = parser.parse_args(argv)
    try:
        written = write_results([Path(p) for p in args.results], Path(args.out) if args.out else None)
    except ValueError as error:
        print(f"error: --results: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
