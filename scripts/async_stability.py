"""Why async momentum SGD diverges, and what each correction buys: a quadratic model.

N workers push in turn (round robin: every push is N-1 versions stale, as measured on the real
server for N=2) on the loss ``f(x) = lam/2 x^2``. For each way of applying pushes this finds the
largest ``h = lr * lam`` (lr: the run's learning rate) for which x still converges (a run's
sharpest direction must stay below it), and the progress per epoch relative to synchronous SGD
(how far the parameters move along a flat direction, where the gradient is constant):

* sync: N gradients averaged, one step per round (heavy-ball momentum). Limit 2 (1 + momentum).
* plain async: every push applied with the run's lr and momentum (``async_correction: none``).
* implicit momentum: the same with momentum lowered by 1 - 1/N (``implicit_momentum``).
* lookahead: per-worker momentum, lr/N per push, gradients taken at the lookahead point (``lookahead``).

    python scripts/async_stability.py            # Markdown table
    python scripts/async_stability.py --json
"""

from __future__ import annotations

import argparse
import json
import sys

from src.studies.async_stability import stability_rows, stability_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = stability_rows(args.momentum, args.workers)
    print(json.dumps(rows, indent=1) if args.json else stability_table(rows, args.momentum))
    return 0


if __name__ == "__main__":
    sys.exit(main())
