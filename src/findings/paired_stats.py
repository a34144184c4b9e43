"""Statistics that can separate two configurations: paired differences over seeds with bootstrap intervals,
and the figures of an accuracy-against-time curve (time to a threshold, area under the curve).

A matrix runs every configuration at the same seeds (the seed the outer axis, so configurations
alternate within each seed). Two configurations are compared *per seed* (the same data order and
initial model), and the interval is a percentile bootstrap over the seeds of the per-seed
differences (or ratios)::

    a = {0: 0.91, 1: 0.93, ...}               # seed -> figure of configuration A
    b = {0: 0.92, 1: 0.95, ...}
    estimate = paired(a, b, "difference")      # mean of b - a over the common seeds, its 95% interval
    estimate.low, estimate.high

Pure functions of numbers: no I/O. The bootstrap is seeded, so the same inputs give the same interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import numpy as np

RESAMPLES = 10_000
"""Bootstrap resamples per interval (the interval's own Monte Carlo error is then ~0.5% of its width)."""
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds and its bootstrap confidence interval (``low``/``high`` are ``None`` for no values)."""

    mean: float | None
    low: float | None
    high: float | None
    n: int
    values: list[float] = field(default_factory=list)

    def excludes(self, value: float) -> bool:
        """Whether the interval lies entirely on one side of ``value`` (the difference is resolved)."""
        return self.low is not None and (self.low > value or self.high < value)

    def as_dict(self) -> dict[str, object]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n, "values": list(self.values)}


def bootstrap_ci(
    values: Sequence[float], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``.

    Raises:
        ValueError: no values, a value that is not finite, or ``confidence`` outside (0, 1).
    """
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        raise ValueError("bootstrap_ci: no values")
    if not np.isfinite(data).all():
        raise ValueError("bootstrap_ci: values must be finite")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def estimate(values: Sequence[float | None], **bootstrap) -> Estimate:
    """Mean and bootstrap interval of ``values`` (``None`` entries left out: e.g. a target never reached)."""
    kept = [float(v) for v in values if v is not None]
    if not kept:
        return Estimate(None, None, None, 0, [])
    low, high = bootstrap_ci(kept, **bootstrap)
    return Estimate(float(np.mean(kept)), low, high, len(kept), kept)


def paired_by_seed(
    a: Mapping[int, float | None], b: Mapping[int, float | None], kind: Literal["difference", "ratio"] = "ratio"
) -> dict[int, float]:
    """``{seed: b - a}`` (or ``b / a``) over the seeds both have a value for (a ratio also needs ``a != 0``)."""
    if kind not in ("difference", "ratio"):
        raise ValueError(f"paired: kind must be difference or ratio, got {kind!r}")
    out = {}
    for seed in sorted(set(a) & set(b)):
        x, y = a[seed], b[seed]
        if x is None or y is None or (kind == "ratio" and x == 0):
            continue
        out[seed] = y - x if kind == "difference" else y / x
    return out


def paired_values(
    a: Mapping[int, float | None], b: Mapping[int, float | None], kind: Literal["difference", "ratio"] = "difference"
) -> list[float]:
    """Per-seed ``b - a`` (or ``b / a``), over the seeds both have a value for, in seed order."""
    return list(paired_by_seed(a, b, kind).values())


def paired(
    a: Mapping[int, float | None],
    b: Mapping[int, float | None],
    kind: Literal["difference", "ratio"] = "difference",
    **bootstrap,
) -> Estimate:
    """Mean per-seed difference ``b - a`` (or ratio ``b / a``) and its bootstrap interval."""
    return estimate(paired_values(a, b, kind), **bootstrap)


# ----------------------------------------------------------------------------- accuracy-against-time curves


def first_reaching(points: Sequence[tuple[float, float]], threshold: float) -> float | None:
    """The first ``x`` of ``(x, accuracy)`` points (in order of ``x``) whose accuracy is at least ``threshold``."""
    for x, accuracy in sorted(points):
        if accuracy >= threshold:
            return float(x)
    return None


def area_under_curve(points: Sequence[tuple[float, float]], horizon: float) -> float:
    """Mean accuracy over ``[0, horizon]`` of the step curve through ``(time, accuracy)`` points.

    The curve is 0 before the first point and holds each evaluation's accuracy until the next one
    (and the last one up to ``horizon``: a finished run keeps its final model). So a run that gets
    to the same accuracy sooner has the larger area; 1.0 is a perfect model from time 0.

    Raises:
        ValueError: ``horizon`` not > 0.
    """
    if not (math.isfinite(horizon) and horizon > 0):
        raise ValueError(f"area_under_curve: horizon must be > 0, got {horizon}")
    ordered = sorted((t, a) for t, a in points if t < horizon)
    area = 0.0
    for (t, accuracy), following in zip(ordered, ordered[1:] + [(horizon, None)]):
        area += accuracy * (following[0] - t)
    return area / horizon
