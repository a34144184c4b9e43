"""Draw a trace (a trace.json, or the merged one generate_performance_report.py --trace-dir writes) as a PNG timeline.

    python scripts/plot_trace.py reports/perf_report_trace.json --output docs/trace_timeline.png --start 1 --seconds 1.5

Every trace.json under a folder is merged first when the input is a folder (a --trace run's log
folder). See src/reports/plots.py.
"""

from __future__ import annotations

import argparse

from src.reports.plots import draw_timeline
from src.telemetry import tracing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a trace file, or a folder whose trace.json files are merged")
    parser.add_argument("--output", required=True, help="PNG to write")
    parser.add_argument(
        "--start", type=float, default=0.0, help="window start, seconds after the first span (default 0)"
    )
    parser.add_argument("--seconds", type=float, help="window length (default: to the last span)")
    parser.add_argument("--title", default="Timeline", help="the picture's title")
    args = parser.parse_args(argv)
    try:
        events = tracing.load_traces(args.trace)
        print(draw_timeline(events, args.output, start_s=args.start, seconds=args.seconds, title=args.title))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
