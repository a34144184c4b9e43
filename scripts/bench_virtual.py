"""Benchmark the virtual-time driver: its own overhead at 64 workers, and its memory at 64 workers of 23 MB.

    python scripts/bench_virtual.py                       # both cases (~2 min on 2 cores)
    python scripts/bench_virtual.py --skip-memory --output bench_virtual.json

Prints one JSON object (also to ``--output``):

* ``overhead``: 64 simulated async workers of ``simple_cnn`` on ``mnist_5k`` (4 epochs of batch 64,
  dense gradients, a 250 Mbit/s uplink and a 1 Gbit/s server NIC). ``loop_wall_s`` is the simulation's
  wall time from its first event to its summary (``virtual_wall_s`` adds the set-up: data, models,
  the first optimizer's imports); its reference ``gradients_only_s`` is a plain loop computing the same
  number of forward/backward passes on batches of the same size; ``overhead_ratio`` = the first over
  the second (target <= 1.3: the event loop, the server core, the messages' bytes, the replicas and
  the event logs add at most 30%). ``in_run_overhead_ratio`` measures the same in one run: the loop's wall
  time over the part of it spent in the workers' forward/backward passes (``wall_compute_s``), so a
  load that changes between the two measurements cannot tilt it. ``compressed``: the same with top-k 0.1
  and error feedback, whose
  compression is real work on top (``compression_ratio_of_wall`` says how much).
* ``memory``: 64 workers of ``wide_mlp`` (5.8M parameters, 23 MB) pushing dense gradients for a few
  steps each; ``peak_rss_gb`` (target <= 8: at most one parameter replica, one in-flight push and one
  residual per simulated worker) beside ``replicas_gb``, what 64 replicas of the model weigh.

Each case runs in its own process, so one's peak memory does not hide in the other's.
"""

from __future__ import annotations

import argparse
import json
import sys

from src.benchmarks import virtual


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-memory", action="store_true", help="only the overhead case")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    text = json.dumps(virtual.run_benchmark(memory=not args.skip_memory), indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
