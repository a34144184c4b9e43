"""Benchmark: a training step through torch_asgc against the same step made with the raw protocol calls.

    python scripts/bench_library.py [--steps 30] [--rounds 3] [--model simple_cnn]

ours:      forward/backward + ``DistributedOptimizer.step()`` (compensate, compress, push, load the reply)
reference: the same forward/backward + what our own PS worker does per step with the raw client
           (``encode_gradients`` -> ``ParameterServerClient.push`` -> ``settle_push`` -> ``load_reply``)

Both are workers of one in-process :class:`~torch_asgc.server.ClientLoopServer` (async, so neither
waits for the other), on the same batches of mnist_5k, alternating blocks of ``--steps`` steps for
``--rounds`` rounds; the figure is the median step time. Uncompressed and top-k 0.01 (+ error
feedback). The ratio is the library's overhead over the protocol itself; target <= 1.10.
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json

from src.benchmarks import library


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="simple_cnn")
    args = parser.parse_args(argv)
    print(json.dumps(library.run_benchmark(args.steps, args.rounds, args.model), indent=2))


if __name__ == "__main__":
    main()
