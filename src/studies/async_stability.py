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

Pure numpy, no I/O; ``scripts/async_stability.py`` prints the table (docs/async.md).
"""

from __future__ import annotations

import math

import numpy as np

METHODS = ("sync", "plain", "implicit_momentum", "lookahead")
STEPS = 4000


def diverges(h: float, momentum: float, num_workers: int, method: str) -> bool:
    """Whether x_t escapes on the quadratic for ``h = lr * lam`` (lr in the run's units)."""
    n = num_workers
    x, shared = 1.0, 0.0
    buffers = np.zeros(n)
    points = np.full(n, x)  # where each worker computes its next gradient
    mu = momentum
    if method == "implicit_momentum":
        mu = max(0.0, momentum - (1.0 - 1.0 / n))
    for t in range(STEPS):
        if method == "sync":
            shared = momentum * shared + h * x
            x -= shared
        else:
            k = t % n
            gradient = h * points[k]
            if method == "lookahead":
                buffers[k] = momentum * buffers[k] + gradient
                x -= buffers[k] / n
                points[k] = x - momentum * buffers.sum() / n
            else:
                shared = mu * shared + gradient
                x -= shared
                points[k] = x
        if not math.isfinite(x) or abs(x) > 1e6:
            return True
    return abs(x) > 0.5


def largest_stable_h(momentum: float, num_workers: int, method: str) -> float:
    """Smallest h on a fine log grid at which the run diverges (the stability limit)."""
    for h in np.geomspace(1e-3, 8.0, 1200):
        if diverges(float(h), momentum, num_workers, method):
            return float(h)
    return 8.0


def progress_per_epoch(momentum: float, num_workers: int, method: str) -> float:
    """Movement per epoch along a flat direction (constant gradient), relative to sync."""
    n = num_workers
    sync = (1.0 / n) / (1.0 - momentum)  # one step of lr/(1-mu) per N pushes
    if method == "sync" or method == "lookahead":
        return 1.0
    mu = momentum if method == "plain" else max(0.0, momentum - (1.0 - 1.0 / n))
    return (1.0 / (1.0 - mu)) / sync


def stability_rows(momentum: float, workers: list[int]) -> list[dict]:
    """One row per worker count and method: its stability limit and its progress per epoch vs sync."""
    return [
        {
            "workers": n,
            "method": method,
            "largest_stable_lr_times_lam": round(largest_stable_h(momentum, n, method), 3),
            "progress_per_epoch_vs_sync": round(progress_per_epoch(momentum, n, method), 2),
        }
        for n in workers
        for method in METHODS
    ]


def stability_table(rows: list[dict], momentum: float) -> str:
    """``rows`` as the Markdown table docs/async.md shows, under a line naming the momentum."""
    lines = [
        f"momentum {momentum}, round-robin pushes (staleness N-1)\n",
        "| N | method | largest stable lr x curvature | progress per epoch vs sync |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {row['workers']} | {row['method']} | {row['largest_stable_lr_times_lam']} "
        f"| {row['progress_per_epoch_vs_sync']} |"
        for row in rows
    ]
    return "\n".join(lines)
