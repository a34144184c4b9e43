"""What the timeline spans and the exposed-communication measurement cost a training step.

    python scripts/bench_spans.py            # prints a JSON object (the figures docs/observability.md quotes)

* ``span_off_us`` / ``record_off_us``: one ``tracing.span`` / ``tracing.record`` with no tracer
  and no profiler (what every run without ``--trace`` pays per span);
* ``span_on_us``: one span recorded into a ``trace.json``;
* ``backward_wait_hook_us_per_parameter``: what one post-accumulate-grad hook of
  :class:`src.telemetry.exposed_comm.BackwardWait` adds to a backward pass (8 one-element parameters, with
  the hooks minus without);
* ``ddp_step_ms`` with and without :class:`src.telemetry.exposed_comm.BackwardWait` (a post-accumulate-grad
  hook per parameter, on in every DDP run): ``simple_cnn`` at batch 64 on one gloo rank, steps
  alternated between the two so that machine load hits both alike; medians of ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import json

from src.benchmarks import spans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000, help="spans timed per measurement")
    parser.add_argument("--steps", type=int, default=100, help="DDP steps timed with and without the measurement, each")
    args = parser.parse_args(argv)
    print(json.dumps(spans.run_benchmark(args.calls, args.steps), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
