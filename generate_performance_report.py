"""Consolidated performance report of baseline, parameter-server and DDP runs: JSON, Markdown, HTML, plots.

From the files the runners write with --artifacts-dir (each runner adds its own files to the folder):

    python run_baseline_training.py --artifacts-dir artifacts
    python run_parameter_server_training.py --workers 2 --artifacts-dir artifacts
    python run_ddp_training.py --world-size 2 --artifacts-dir artifacts
    python generate_performance_report.py --output reports/perf_report.json --baseline-json artifacts/baseline.json \\
        --ps-json artifacts/ps.json --ddp-rank-json artifacts/ddp_rank_0.json artifacts/ddp_rank_1.json \\
        --worker-metrics-json artifacts/worker_metrics.json

or from every run summary and event log under a folder (as many runs of each architecture as it holds):

    python generate_performance_report.py --runs-dir logs --output reports/perf_report.json

A run trained with --trace wrote a Chrome trace-event timeline per process (trace.json in each log
folder); --trace-dir LOG_DIR merges every trace.json under it into perf_report_trace.json beside the
report (one clock: open it in https://ui.perfetto.dev or chrome://tracing), which the report links:

    python run_ddp_training.py --world-size 2 --trace --artifacts-dir artifacts
    python generate_performance_report.py --ddp-rank-json artifacts/ddp_rank_*.json --trace-dir logs/ddp_cli

Writes reports/perf_report.json, and beside it perf_report.md, perf_report.html (self-contained: the
plots are inlined) and the PNG plots in perf_report_plots/. Each JSON's events are read from
<stem>_events.jsonl beside it (baseline_events.jsonl, ps_events.jsonl, ddp_events.jsonl) when there.
A missing, malformed or foreign input prints one line naming the file and the problem and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--output",
        default="reports/perf_report.json",
        help="JSON report path; .md, .html and <stem>_plots/ go beside it (default reports/perf_report.json)",
    )
    parser.add_argument(
        "--baseline-json", help="baseline run summary (artifacts/baseline.json or logs/test_baseline/summary.json)"
    )
    parser.add_argument(
        "--ps-json", help="parameter-server run summary (artifacts/ps.json or logs/ps_cli/summary.json)"
    )
    parser.add_argument(
        "--ddp-rank-json",
        nargs="+",
        default=[],
        metavar="PATH",
        help="every DDP rank's summary of one run (artifacts/ddp_rank_<r>.json)",
    )
    parser.add_argument(
        "--worker-metrics-json",
        help="parameter-server per-worker metrics (artifacts/worker_metrics.json; default: the 'workers' of --ps-json)",
    )
    parser.add_argument("--runs-dir", help="also take every run summary and event log under this folder")
    parser.add_argument("--bench-json", help="benchmarks from scripts/bench_all.py (reports/bench.json)")
    parser.add_argument(
        "--trace-dir",
        action="append",
        default=[],
        metavar="LOG_DIR",
        help="merge every trace.json under this run's log folder (a --trace run) into <stem>_trace.json "
        "beside the report, and link it; repeatable",
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        help="for runs whose summary records no time to target: first eval at or above this, in (0, 1]",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.baseline_json or args.ps_json or args.ddp_rank_json or args.runs_dir or args.worker_metrics_json):
        parser.error("nothing to report: give --baseline-json / --ps-json / --ddp-rank-json, or --runs-dir")
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        parser.error(f"--target-accuracy must be in (0, 1], got {args.target_accuracy}")

    from src.reports.inputs import ReportInputError, read_json, runs_from_dir, runs_from_files
    from src.reports.report import build_report, merge_run_traces, write_report

    try:
        runs = runs_from_files(
            baseline=args.baseline_json,
            ps=args.ps_json,
            ddp_ranks=args.ddp_rank_json,
            worker_metrics=args.worker_metrics_json,
        )
        if args.runs_dir:
            runs += runs_from_dir(args.runs_dir)
        bench = None
        if args.bench_json:
            bench = read_json(args.bench_json)
            if not isinstance(bench, dict) or not isinstance(bench.get("figures"), list):
                raise ReportInputError(
                    args.bench_json, "not a benchmark file of scripts/bench_all.py (no 'figures' list)"
                )
        trace = merge_run_traces(args.trace_dir, Path(args.output)) if args.trace_dir else None
    except ReportInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    inputs = [
        p
        for p in (
            args.baseline_json,
            args.ps_json,
            *args.ddp_rank_json,
            args.worker_metrics_json,
            args.runs_dir,
            args.bench_json,
            *args.trace_dir,
        )
        if p
    ]
    report = build_report(runs, bench=bench, target_accuracy=args.target_accuracy, inputs=inputs, trace=trace)
    paths = write_report(report, args.output)
    if trace:
        print(
            f"trace: {Path(args.output).parent / trace['file']} "
            f"({len(trace['processes'])} processes, {trace['spans']} spans)"
        )
    print(
        f"report: {paths['json']}\nmarkdown: {paths['markdown']}\nhtml: {paths['html']}\n"
        f"plots: {paths['plot:accuracy_vs_time'].parent}/ ({len(report['plots'])} PNG)"
    )
    for run in report["runs"]:
        speedup = run["speedup_vs_baseline"]
        print(
            f"  {run['label']:<28} accuracy "
            f"{run['final_accuracy'] * 100 if run['final_accuracy'] is not None else float('nan'):6.2f}%  "
            f"{run['throughput_samples_per_s']:9.1f} samples/s"
            + (f"  {speedup:.2f}x baseline" if speedup is not None else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
