"""Plots and a Markdown table of finished experiment runs (:mod:`src.reports.plots`).

    python scripts/plot_results.py                                   # everything under results/
    python scripts/plot_results.py --results-dir /scratch/results    # everything under another results folder
    python scripts/plot_results.py --results results/matrix_smoke
    python scripts/plot_results.py --results results/f1 results/f8 --out results/plots

With no ``--results``, every matrix in the results folder (``--results-dir``, default ``results``: where
run_experiment.py and run_matrix.py write) is drawn into its own ``<matrix>/plots/``, and the single runs
there (from run_experiment.py) together into ``results/plots/``; folders without a finished run are left
out. ``--results`` takes run folders (holding ``summary.json``) or folders of them (a matrix) and draws
them together into ``--out`` (default: the first results folder's ``plots/``); unfinished runs are left
out. Everything is read from the runs' summaries and ``events.jsonl`` files (the source of truth). Each
plots folder holds:

| file | what |
|---|---|
| ``accuracy_vs_time.png`` | test accuracy against seconds of training (every evaluation) |
| ``accuracy_vs_bytes.png`` | test accuracy against the bytes the workers moved until then (sent + received) |
| ``time_to_target.png`` | time to target accuracy per configuration: mean, spread and each seed |
| ``bytes_per_run.png`` | bytes sent and received per run |
| ``staleness.png`` | staleness histograms of the async runs |
| ``controller.png`` | the adaptive controller's top-k fraction over time (its ``controller`` events) |
| ``results.md`` | a table of every run, and one per configuration over its seeds (mean ± std) |

A configuration is a run name without its ``seed-N`` part (run_matrix.py names runs that way). Prints
every file written; with nothing to draw, one ``error:`` line and exit status 1.
"""

import argparse
import sys
from pathlib import Path

from src.reports.plots import write_results, write_results_under


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sources = parser.add_mutually_exclusive_group()
    sources.add_argument("--results", nargs="+", help="run folders or folders of runs, drawn together")
    sources.add_argument(
        "--results-dir",
        default="results",
        help="without --results: draw every matrix and the single runs in this folder (default results)",
    )
    parser.add_argument("--out", help="with --results: output folder (default <first --results>/plots)")
    args = parser.parse_args(argv)
    if args.out and not args.results:
        parser.error("--out goes with --results (without it, each matrix's plots go to its own plots/ folder)")
    try:
        if args.results:
            written = write_results([Path(p) for p in args.results], Path(args.out) if args.out else None)
        else:
            written = write_results_under(Path(args.results_dir))
    except ValueError as error:
        print(f"error: {'--results: ' if args.results else ''}{error}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
