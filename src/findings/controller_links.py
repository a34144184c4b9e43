"""F14: the adaptive controller's default policy against every fixed compression, on four links.

The matrix ``f14_links`` runs, on each link (``drop``: 250 -> 25 Mbit/s, F11's; ``up250``: a steady 250 Mbit/s; ``lan``:
10 Gbit/s; ``rise``: 25 -> 250 Mbit/s), dense, every fixed top-k rho in {0.5, 0.25, 0.1, 0.05, 0.01}, the controller
(``link`` policy, one configuration for every link) and the spec's first controller (``rebound`` policy). :func:`f14`
judges the controller against its targets (no later than the best fixed compression, in as many seeds, with at most 1.2x
its bytes), link by link and target by target:

* the **best fixed arm** for a link and target is the one that reaches the target in the most seeds, and among
  those the soonest on the mean;
* **time**: the paired ratio controller / best (per seed, both reaching it) must have an interval whose low end
  is at most 1 (it includes 1 or lies below it);
* **seeds**: the controller reaches the target in at least as many seeds as the best arm;
* **bytes**: bytes to the target, controller / best, at most 1.2 on the mean;
* on ``lan``, time within 5% of dense's: the paired ratio controller / dense at most 1.05 on the mean.

Bytes to a target are a run's bytes sent in proportion to the pushes applied before the evaluation that reached
it (exact for a fixed arm, whose pushes weigh the same; for a controller that compresses less later in the
run, it counts the later, heavier pushes' weight from the start: more than it sent).
"""

from __future__ import annotations

from typing import Any, Callable

from src.findings.paired_stats import Estimate, first_reaching
from src.findings.runs import Matrix, bytes_sent, final_accuracy, time_to

MATRIX = "f14_links"
LINKS = {
    "drop": "250 -> 25 Mbit/s at 4 s (F11)",
    "up250": "250 Mbit/s (F8)",
    "lan": "10 Gbit/s (F10)",
    "rise": "25 -> 250 Mbit/s at 8 s",
}
FIXED = {
    "dense": "dense",
    "rho50": "fixed 0.5",
    "rho25": "fixed 0.25",
    "rho10": "fixed 0.1",
    "rho5": "fixed 0.05",
    "rho1": "fixed 0.01",
}
CONTROLLERS = {"controller": "controller (link)", "rebound": "old controller (rebound)"}
BYTES_LIMIT = 1.2
LAN_LIMIT = 1.05


def bytes_to(threshold: float) -> Callable[[dict[str, Any]], float | None]:
    """MB sent before the first evaluation at or above ``threshold``: the run's bytes times the share of its pushes
    applied by then (``None``: never reached)."""

    def figure(run: dict[str, Any]) -> float | None:
        step = first_reaching([(e[4], e[2]) for e in run["evals"] if e[4] is not None], threshold)
        last = max((e[4] for e in run["evals"] if e[4] is not None), default=0)
        return None if step is None or not last else bytes_sent(run) / 1e6 * step / last

    return figure


def _e(value: Estimate) -> dict[str, Any]:
    return value.as_dict()


def _count(matrix: Matrix, name: str, figure) -> int:
    return sum(v is not None for v in matrix.values(name, figure).values())


def _best(matrix: Matrix, link: str, threshold: float) -> tuple[str | None, int]:
    """The fixed arm reaching ``threshold`` in the most seeds, the soonest among those; and that count."""
    counts = {arm: _count(matrix, f"{link}__{arm}", time_to(threshold)) for arm in FIXED}
    most = max(counts.values(), default=0)
    if not most:
        return None, 0
    tied = [arm for arm, count in counts.items() if count == most]
    return min(tied, key=lambda arm: matrix.estimate(f"{link}__{arm}", time_to(threshold)).mean), most


def _against(matrix: Matrix, link: str, best: str, controller: str, threshold: float, most: int) -> dict[str, Any]:
    a, b = f"{link}__{best}", f"{link}__{controller}"
    ratio = matrix.paired(a, b, time_to(threshold), "ratio")
    data = matrix.paired(a, b, bytes_to(threshold), "ratio")
    reached = _count(matrix, b, time_to(threshold))
    return {
        "time_ratio": _e(ratio),
        "bytes_ratio": _e(data),
        "reached": reached,
        "met": {
            "time": ratio.low is not None and ratio.low <= 1.0,
            "seeds": reached >= most,
            "bytes": data.mean is not None and data.mean <= BYTES_LIMIT,
        },
    }


def f14(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """Every arm's time and bytes to both targets on every link, and the controllers against each cell's best arm."""
    matrix = matrices.get(MATRIX)
    if matrix is None or not any(name.endswith("__controller") for name in matrix.by):
        return {}
    low, high = matrix.thresholds
    out: dict[str, Any] = {"seeds": len(matrix.seeds), "thresholds": [low, high], "links": {}}
    for link in LINKS:
        cell: dict[str, Any] = {"arms": {}, "targets": {}}
        for arm in [*FIXED, *CONTROLLERS]:
            name = f"{link}__{arm}"
            cell["arms"][arm] = {
                "time_to_target_s": {str(t): _e(matrix.estimate(name, time_to(t))) for t in (low, high)},
                "reached": {str(t): matrix.reached(name, time_to(t)) for t in (low, high)},
                "bytes_to_target_mb": {str(t): _e(matrix.estimate(name, bytes_to(t))) for t in (low, high)},
                "final_accuracy": _e(matrix.estimate(name, final_accuracy)),
            }
        for t in (low, high):
            best, most = _best(matrix, link, t)
            target: dict[str, Any] = {"best": best, "best_reached": most}
            if best is not None:
                for controller in CONTROLLERS:
                    target[controller] = _against(matrix, link, best, controller, t, most)
            if link == "lan":
                ratio = matrix.paired(f"{link}__dense", f"{link}__controller", time_to(t), "ratio")
                target["vs_dense"] = {
                    "time_ratio": _e(ratio),
                    "met": ratio.mean is not None and ratio.mean <= LAN_LIMIT,
                }
            cell["targets"][str(t)] = target
        out["links"][link] = cell
    met = [
        all(target["controller"]["met"].values()) and target.get("vs_dense", {}).get("met", True)
        for cell in out["links"].values()
        for target in cell["targets"].values()
        if "controller" in target
    ]
    out["cells_met"] = [sum(met), len(met)]
    out["aa"] = {
        "time_to_target_ratio": _e(matrix.paired("drop__rho5", "drop__rho5_aa", time_to(low), "ratio")),
        "final_accuracy_difference": _e(matrix.paired("drop__rho5", "drop__rho5_aa", final_accuracy)),
    }
    return out
