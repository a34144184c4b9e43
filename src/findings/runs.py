"""The runs of a finding: a matrix's record by configuration and seed, and the figures of one run.

A findings matrix (``configs/experiments/f*.yaml``, its record :mod:`src.findings.record`) is read into a
:class:`Matrix`, whose ``values(configuration, figure)`` is ``{seed: figure(run)}``: the paired statistics of
:mod:`src.findings.figures` compare two configurations seed by seed. The figures of a run:

* **throughput**: samples applied per second of training (the summary's);
* **time / samples to a threshold**: of the first evaluation at or above it (evaluations are at fixed
  sample counts, ``training.eval_every_samples``, the same in sync and async);
* **area under the accuracy-time curve** (:func:`src.findings.paired_stats.area_under_curve`): over the longer
  run of the pair, each run holding its final accuracy after it ends;
* **ideal async/sync ratio** (F1): the async run's per-worker rates (samples over busy seconds)
  summed, over N times the slowest: what sync would reach if every round took the slowest worker's
  step and async if no worker ever waited;
* **per-step ceiling** (F8): per push, (compute + communication) of the dense run over that of the
  compressed run: the speed-up to target if both needed the same samples.
"""

from __future__ import annotations

from typing import Any, Callable

from src.findings.paired_stats import Estimate, area_under_curve, estimate, first_reaching, paired

THRESHOLDS = {
    "f1_stragglers": (0.85, 0.9),
    "f1_scaling": (0.6, 0.7),
    "f2_compression": (0.85, 0.9),
    "f8_bandwidth": (0.8, 0.85),
    "f11_controller": (0.8, 0.85),
    "f13_shards": (0.75, 0.8),
    "f14_links": (0.8, 0.85),
}
"""The two accuracies whose time to target each matrix reports (both reached by most arms at its size; at 8 and 16
workers sync takes 42 and 21 averaged steps in its 3 epochs, so its thresholds are lower; F13's sync takes 12)."""
MATRICES = tuple(THRESHOLDS)
REALTIME = {"realtime_f1": (0.65, 0.7), "realtime_f8": (0.8, 0.85)}
"""Confirmations on the real clock (2-3 seeds, processes and gRPC): their thresholds."""


# ----------------------------------------------------------------------------- per-run figures


def throughput(run: dict[str, Any]) -> float:
    return run["summary"]["throughput_samples_per_s"]


def final_accuracy(run: dict[str, Any]) -> float:
    return run["summary"]["final_accuracy"]


def bytes_sent(run: dict[str, Any]) -> float:
    return float(run["summary"]["bytes_sent"])


def train_time(run: dict[str, Any]) -> float:
    return run["summary"]["train_time_s"]


def _curve(run: dict[str, Any], x: int) -> list[tuple[float, float]]:
    return [(e[x], e[2]) for e in run["evals"] if e[x] is not None]


def time_to(threshold: float) -> Callable[[dict[str, Any]], float | None]:
    return lambda run: first_reaching(_curve(run, 1), threshold)


def samples_to(threshold: float) -> Callable[[dict[str, Any]], float | None]:
    return lambda run: first_reaching(_curve(run, 0), threshold)


def worker_rates(run: dict[str, Any]) -> dict[int, float]:
    """Each worker's samples over its busy seconds (gradient + compression + communication), incarnations added."""
    rates: dict[int, float] = {}
    for w in run["summary"]["workers"]:
        busy = w["gradient_time_s"] + w["compression_time_s"] + w["communication_time_s"]
        if busy > 0 and w["samples"]:
            rates[w["worker_id"]] = rates.get(w["worker_id"], 0.0) + w["samples"] / busy
    return rates


def ideal_ratio(run: dict[str, Any]) -> float | None:
    rates = worker_rates(run)
    return sum(rates.values()) / (len(rates) * min(rates.values())) if rates else None


def per_step_s(run: dict[str, Any]) -> float | None:
    workers = [w for w in run["summary"]["workers"] if w.get("steps")]
    steps = sum(w["steps"] for w in workers)
    busy = sum(w["gradient_time_s"] + w["compression_time_s"] + w["communication_time_s"] for w in workers)
    return busy / steps if steps else None


# --------------------------------------------------------------------------- a matrix's runs by configuration and seed


class Matrix:
    """A matrix's record: ``values(configuration, figure)`` is ``{seed: figure(run)}``."""

    def __init__(self, record: dict[str, Any]):
        self.name = record["matrix"]
        self.runs = record["runs"]
        self.by: dict[str, dict[int, dict[str, Any]]] = {}
        for run in self.runs:
            self.by.setdefault(run["configuration"], {})[run["seed"]] = run
        self.thresholds = {**THRESHOLDS, **REALTIME}.get(self.name, (0.8, 0.9))

    @property
    def seeds(self) -> list[int]:
        return sorted({run["seed"] for run in self.runs})

    def values(self, configuration: str, figure: Callable[[dict[str, Any]], float | None]) -> dict[int, float | None]:
        return {seed: figure(run) for seed, run in self.by.get(configuration, {}).items()}

    def estimate(self, configuration: str, figure) -> Estimate:
        return estimate(list(self.values(configuration, figure).values()))

    def paired(self, a: str, b: str, figure, kind: str = "difference") -> Estimate:
        """Per seed, ``figure(b) - figure(a)`` (or ``/``), and its interval."""
        return paired(self.values(a, figure), self.values(b, figure), kind)

    def auc_difference(self, a: str, b: str) -> Estimate:
        """Per seed, area under b's accuracy-time curve minus a's, over the longer of the two runs."""
        differences = []
        for seed in sorted(set(self.by.get(a, {})) & set(self.by.get(b, {}))):
            x, y = self.by[a][seed], self.by[b][seed]
            horizon = max(train_time(x), train_time(y))
            differences.append(area_under_curve(_curve(y, 1), horizon) - area_under_curve(_curve(x, 1), horizon))
        return estimate(differences)

    def reached(self, configuration: str, figure) -> str:
        values = self.values(configuration, figure)
        return f"{sum(v is not None for v in values.values())}/{len(values)}"
