"""Issue 34's reference: PS against DDP on tc-shaped links in network namespaces, exposed communication of each.

    python scripts/bench_overlap.py --output overlap.json              # the reference run (~1.5 min on 2 cores)
    python scripts/bench_overlap.py --mbps 80 --mtu 0 --transport grpc --reference docs/overlap_reference.json
    python scripts/bench_overlap.py --reference overlap.json           # a later worker against that reference
    python scripts/bench_overlap.py --streaming --transport tcp        # streamed against unstreamed, in one run
    python scripts/bench_overlap.py --streaming --transport tcp --pipelined-replies   # and with pipelined replies

Two workers, each in a network namespace whose link is shaped by tc tbf to --mbps both ways, the PS server in an
unshaped one (the router); a sync PS run, then a 2-rank DDP run on the same links (src/benchmarks/overlap.py says
what each field means). Progress goes to stderr, the JSON to stdout; --output also writes it to a file. Needs root.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from src.benchmarks import overlap
from src.benchmarks.common import emit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--mbps",
        type=float,
        default=overlap.DEFAULT_MBPS,
        help="each worker's link, Mbit/s each way (default %(default)g)",
    )
    parser.add_argument(
        "--epochs", type=int, default=overlap.DEFAULT_EPOCHS, help="epochs of mnist_5k per arm (default %(default)d)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=overlap.DEFAULT_BATCH_SIZE,
        help="batch per worker / rank (default %(default)d)",
    )
    parser.add_argument(
        "--mtu",
        type=int,
        default=overlap.DEFAULT_MTU,
        help="every link's MTU (default %(default)d: jumbo frames; 0: the kernel's 1500, as the first reference)",
    )
    parser.add_argument("--max-train-samples", type=int, help="train on the first N samples only (default all)")
    parser.add_argument("--transport", choices=("grpc", "tcp"), default="grpc", help="the PS's (default grpc)")
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="the PS workers stream (issue 34); the same run measures them without streaming first, as the reference",
    )
    parser.add_argument(
        "--pipelined-replies",
        action="store_true",
        help="with --streaming: the PS arm's server also sends each slice back as soon as it is "
        "stepped; the same run measures the streamed arm without it too (ps_streamed)",
    )
    parser.add_argument(
        "--trace-dir", help="trace the PS runs and keep each arm's trace.json files here (scripts/plot_trace.py)"
    )
    parser.add_argument("--reference", help="an earlier run's JSON (same settings): judge issue 34's targets on it")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        reference = json.loads(Path(args.reference).read_text()) if args.reference else None
        result = overlap.bench_overlap(
            args.mbps,
            args.epochs,
            args.batch_size,
            max_train_samples=args.max_train_samples,
            transport=args.transport,
            reference=reference,
            streaming=args.streaming,
            pipelined=args.pipelined_replies,
            mtu=args.mtu or None,
            trace_dir=Path(args.trace_dir) if args.trace_dir else None,
        )
    except (OSError, ValueError, RuntimeError) as exc:  # JSONDecodeError: a ValueError; RuntimeError: a run failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return emit(result, args.output)


if __name__ == "__main__":
    sys.exit(main())
