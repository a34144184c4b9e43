"""Benchmark the gradient compressors on the per-step hot path; prints one JSON object.

    python scripts/bench_compression.py              # 1M and 11M float32 entries, 7 repeats
    python scripts/bench_compression.py --sizes 1000000 --repeats 3

For each size and compressor: compress / decompress / compress+decompress milliseconds (median
over repeats, after one warm-up), throughput in input MB/s, wire bytes and compression ratio
(identity bytes / wire bytes). ``torch.topk`` alone (k = 1% of n, magnitudes precomputed) is the
floor of exact selection, and ``sampled_topk_speedup`` compares the sampled top-k against it
(target >= 5x at 11M). Timings share the machine with whatever else runs: ``load_average`` is
recorded so noisy numbers can be recognised.
"""

from __future__ import annotations

import argparse
import json
import sys

from src.benchmarks import compression


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 11_000_000])
    parser.add_argument("--repeats", type=int, default=7)
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    command = "python scripts/bench_compression.py " + " ".join(arguments)
    print(json.dumps(compression.run_benchmark(args.sizes, args.repeats, command)))


if __name__ == "__main__":
    main()
