"""Benchmark fault tolerance: detection latency, time back to full throughput, accuracy against no faults.

    python scripts/bench_faults.py                    # ~5 min on 2 cores
    python scripts/bench_faults.py --output bench_faults.json

Runs a local parameter-server job (3 workers, sync, mnist_5k, 2 epochs, batch 32) once without
faults, then once per scenario with the same seed:

* ``worker_kill``: ``kill:worker=1@step=15`` (SIGKILL; the launcher restarts it);
* ``worker_hang``: ``hang:worker=1@step=15`` (SIGSTOP; the server fails it, the launcher kills and restarts it);
* ``server_kill``: ``kill:server@version=40`` (the launcher restarts it from its newest checkpoint).

Figures, each read from the run's events:

* ``detection_latency_s``: from the worker's ``fault_injected`` event to the server's
  ``worker_failed``, beside ``heartbeat_timeout_s`` (a server kill is noticed by the launcher at once).
* ``time_to_full_throughput_s``: from the fault to the first moment the applied-sample rate (over a
  ``--window-s`` sliding window of ``update`` events) is back to 90% of its median before the fault.
* ``accuracy_delta``: final accuracy minus the fault-free run's.
* ``samples_covered_once``: every index of every epoch in exactly one applied update.

Progress goes to stderr, the JSON to stdout (``--output`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import sys

from src.benchmarks import faults
from src.benchmarks.common import emit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", choices=sorted(faults.SCENARIOS), default=list(faults.SCENARIOS))
    parser.add_argument("--window-s", type=float, default=3.0, help="sliding window of the throughput rate")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    results = faults.run_benchmark(args.scenarios, args.window_s, args.heartbeat_timeout)
    return emit(results, args.output)


if __name__ == "__main__":
    sys.exit(main())
