"""The spec's findings F1-F12, computed from the committed records of their matrices (docs/findings/*.json).

Each finding is one or two matrices (``configs/experiments/f*.yaml``, virtual time, seed the outer
axis, at least 8 seeds, an A/A arm). :func:`compute` turns their records (:mod:`src.findings_record`)
into figures, every comparison paired by seed with a bootstrap 95% interval (:mod:`src.paired_stats`);
:func:`render` writes them as the Markdown blocks of ``docs/findings.md``, between
``<!-- findings:NAME -->`` and ``<!-- /findings:NAME -->``. :func:`check_document` says which blocks of
a document differ from what the records give, :func:`update_document` rewrites them.

Figures of a run:

* **throughput**: samples applied per second of training (the summary's);
* **time / samples to a threshold**: of the first evaluation at or above it (evaluations are at fixed
  sample counts, ``training.eval_every_samples``, the same in sync and async);
* **area under the accuracy-time curve** (:func:`src.paired_stats.area_under_curve`): over the longer
  run of the pair, each run holding its final accuracy after it ends;
* **ideal async/sync ratio** (F1): the async run's per-worker rates (samples over busy seconds)
  summed, over N times the slowest: what sync would reach if every round took the slowest worker's
  step and async if no worker ever waited;
* **per-step ceiling** (F8): per push, (compute + communication) of the dense run over that of the
  compressed run: the speed-up to target if both needed the same samples.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable

from src.paired_stats import Estimate, area_under_curve, estimate, first_reaching, paired, paired_by_seed

THRESHOLDS = {
    "f1_stragglers": (0.85, 0.9),
    "f1_scaling": (0.6, 0.7),
    "f2_compression": (0.85, 0.9),
    "f8_bandwidth": (0.8, 0.85),
    "f11_controller": (0.8, 0.85),
}
"""The two accuracies whose time to target each matrix reports (both reached by most arms at its size; at 8 and 16
workers sync takes 42 and 21 averaged steps in its 3 epochs, so its thresholds are lower)."""
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


# ----------------------------------------------------------------------------- a matrix's runs by configuration and seed


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


# ----------------------------------------------------------------------------- the findings


def _e(estimate_: Estimate) -> dict[str, Any]:
    return estimate_.as_dict()


def f1(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """Async against sync under stragglers, at 3 (the spec's setup), 8 and 16 workers."""
    out: dict[str, Any] = {}
    levels = [("3", matrices.get("f1_stragglers"), "")]
    levels += [(n, matrices.get("f1_scaling"), f"w{n}__") for n in ("8", "16")]
    for workers, matrix, prefix in levels:
        if matrix is None or f"{prefix}sync" not in matrix.by:
            continue
        name = lambda configuration, prefix=prefix: f"{prefix}{configuration}"  # noqa: E731
        low, high = matrix.thresholds
        level: dict[str, Any] = {
            "seeds": len(matrix.seeds),
            "thresholds": [low, high],
            "sync_throughput": _e(matrix.estimate(name("sync"), throughput)),
        }
        for setup in ("async_plain", "async_lookahead"):
            a = name(setup)
            ratio = paired(matrix.values(name("sync"), throughput), matrix.values(a, throughput), "ratio")
            ideal = matrix.values(a, ideal_ratio)
            achieved = paired_by_seed(matrix.values(name("sync"), throughput), matrix.values(a, throughput))
            fraction = paired(ideal, achieved, "ratio")  # per seed: (async / sync) / ideal
            level[setup] = {
                "throughput_ratio": _e(ratio),
                "ideal_ratio": _e(estimate(list(ideal.values()))),
                "fraction_of_ideal": _e(fraction),
                "time_to_target_speedup": {
                    str(t): _e(matrix.paired(a, name("sync"), time_to(t), "ratio")) for t in (low, high)
                },
                "samples_to_target": {
                    str(t): {
                        "sync": _e(matrix.estimate(name("sync"), samples_to(t))),
                        "async": _e(matrix.estimate(a, samples_to(t))),
                        "reached": {
                            "sync": matrix.reached(name("sync"), samples_to(t)),
                            "async": matrix.reached(a, samples_to(t)),
                        },
                    }
                    for t in (low, high)
                },
                "auc_difference": _e(matrix.auc_difference(name("sync"), a)),
                "final_accuracy_difference": _e(matrix.paired(name("sync"), a, final_accuracy)),
                "final_accuracy": _e(matrix.estimate(a, final_accuracy)),
            }
        level["sync_final_accuracy"] = _e(matrix.estimate(name("sync"), final_accuracy))
        level["aa"] = {
            "throughput_ratio": _e(matrix.paired(name("sync"), name("sync_aa"), throughput, "ratio")),
            "final_accuracy_difference": _e(matrix.paired(name("sync"), name("sync_aa"), final_accuracy)),
        }
        out[workers] = level
    return out


def f3(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """Staleness control (soft weight + hard bound 4) against plain async: insurance, not speed."""
    matrix = matrices.get("f1_stragglers")
    if matrix is None or "async_plain_bounded" not in matrix.by:
        return {}
    plain, bounded = "async_plain", "async_plain_bounded"
    low, high = matrix.thresholds
    rejected = lambda run: float(run["summary"]["pushes_rejected"])  # noqa: E731
    applied = lambda run: float(run["applied_max_staleness"])  # noqa: E731
    return {
        "seeds": len(matrix.seeds),
        "bytes_ratio": _e(matrix.paired(plain, bounded, bytes_sent, "ratio")),
        "pushes_rejected": _e(matrix.estimate(bounded, rejected)),
        "applied_max_staleness": {
            "plain": _e(matrix.estimate(plain, applied)),
            "bounded": _e(matrix.estimate(bounded, applied)),
        },
        "time_to_target_ratio": {str(t): _e(matrix.paired(plain, bounded, time_to(t), "ratio")) for t in (low, high)},
        "reached": {
            str(t): {"plain": matrix.reached(plain, time_to(t)), "bounded": matrix.reached(bounded, time_to(t))}
            for t in (low, high)
        },
        "auc_difference": _e(matrix.auc_difference(plain, bounded)),
        "final_accuracy_difference": _e(matrix.paired(plain, bounded, final_accuracy)),
        "final_accuracy": {
            "plain": _e(matrix.estimate(plain, final_accuracy)),
            "bounded": _e(matrix.estimate(bounded, final_accuracy)),
        },
    }


COMPRESSION_ARMS = ("topk25", "topk25_ef", "topk10", "topk10_ef", "topk1", "topk1_ef", "topk1_ef_warmup")


def f2(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """Bytes and accuracy of top-k with and without error feedback at equal samples (F2/F5, F4, F6)."""
    matrix = matrices.get("f2_compression")
    if matrix is None:
        return {}
    out: dict[str, Any] = {"seeds": len(matrix.seeds)}
    for optimizer in ("sgd", "momentum"):
        dense = f"{optimizer}__dense"
        if dense not in matrix.by:
            continue
        arms: dict[str, Any] = {"dense": {"final_accuracy": _e(matrix.estimate(dense, final_accuracy))}}
        for arm in COMPRESSION_ARMS:
            name = f"{optimizer}__{arm}"
            if name not in matrix.by:
                continue
            arms[arm] = {
                "bytes_ratio": _e(matrix.paired(dense, name, bytes_sent, "ratio")),
                "accuracy_difference": _e(matrix.paired(dense, name, final_accuracy)),
                "final_accuracy": _e(matrix.estimate(name, final_accuracy)),
            }
        arms["aa"] = {
            "accuracy_difference": _e(matrix.paired(dense, f"{optimizer}__dense_aa", final_accuracy)),
            "bytes_ratio": _e(matrix.paired(dense, f"{optimizer}__dense_aa", bytes_sent, "ratio")),
        }
        arms["ef_recovers"] = {
            rho: _e(matrix.paired(f"{optimizer}__topk{rho}", f"{optimizer}__topk{rho}_ef", final_accuracy))
            for rho in ("25", "10", "1")
            if f"{optimizer}__topk{rho}" in matrix.by
        }
        arms["warmup_adds"] = _e(
            matrix.paired(f"{optimizer}__topk1_ef", f"{optimizer}__topk1_ef_warmup", final_accuracy)
        )
        out[optimizer] = arms
    return out


F8_PAIRS = (
    ("lan", "lan_dense", "lan_topk25", "10 Gbit/s", 0.25),
    ("250", "up250_dense", "up250_topk25", "250 Mbit/s", 0.25),
    ("250_rho10", "up250_dense", "up250_topk10", "250 Mbit/s", 0.1),
    ("250_downlink", "updown250_dense", "updown250_topk25", "250 Mbit/s up and down", 0.25),
    ("25", "up25_dense", "up25_topk25", "25 Mbit/s", 0.25),
)


def f8(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """Top-k + error feedback against dense async under narrow links (F8/F9), and on a 10 Gbit/s one (F10)."""
    matrix = matrices.get("f8_bandwidth")
    if matrix is None:
        return {}
    low, high = matrix.thresholds
    out: dict[str, Any] = {"seeds": len(matrix.seeds), "thresholds": [low, high], "links": {}}
    for key, dense, sparse, link, rho in F8_PAIRS:
        if dense not in matrix.by or sparse not in matrix.by:
            continue
        speedups = {str(t): matrix.paired(sparse, dense, time_to(t), "ratio") for t in (low, high)}
        ceiling = matrix.paired(sparse, dense, per_step_s, "ratio")
        fraction = {}
        for t in (low, high):  # per seed: (dense's time / top-k's) / (dense's step / top-k's)
            speed = paired_by_seed(matrix.values(sparse, time_to(t)), matrix.values(dense, time_to(t)))
            steps = paired_by_seed(matrix.values(sparse, per_step_s), matrix.values(dense, per_step_s))
            fraction[str(t)] = paired(steps, speed, "ratio")
        out["links"][key] = {
            "link": link,
            "rho": rho,
            "dense": dense,
            "compressed": sparse,
            "time_to_target_speedup": {t: _e(s) for t, s in speedups.items()},
            "per_step_ceiling": _e(ceiling),
            "fraction_of_ceiling": {t: _e(f) for t, f in fraction.items()},
            "throughput_ratio": _e(matrix.paired(dense, sparse, throughput, "ratio")),
            "bytes_ratio": _e(matrix.paired(dense, sparse, bytes_sent, "ratio")),
            "accuracy_difference": _e(matrix.paired(dense, sparse, final_accuracy)),
            "auc_difference": _e(matrix.auc_difference(dense, sparse)),
            "time_to_target_s": {
                t: {
                    "dense": _e(matrix.estimate(dense, time_to(float(t)))),
                    "compressed": _e(matrix.estimate(sparse, time_to(float(t)))),
                }
                for t in speedups
            },
            "reached": {
                t: {
                    "dense": matrix.reached(dense, time_to(float(t))),
                    "compressed": matrix.reached(sparse, time_to(float(t))),
                }
                for t in speedups
            },
            "per_step_s": {
                "dense": _e(matrix.estimate(dense, per_step_s)),
                "compressed": _e(matrix.estimate(sparse, per_step_s)),
            },
        }
    out["aa"] = {
        "time_to_target_ratio": _e(matrix.paired("up250_dense", "up250_dense_aa", time_to(low), "ratio")),
        "final_accuracy_difference": _e(matrix.paired("up250_dense", "up250_dense_aa", final_accuracy)),
    }
    return out


FIXED_RHOS = (("rho25", 0.25), ("rho10", 0.1), ("rho5", 0.05), ("rho1", 0.01))


def _final_rho(run: dict[str, Any]) -> float | None:
    return run["controller"][-1][1] if run["controller"] else None


def _count(action: str) -> Callable[[dict[str, Any]], float]:
    return lambda run: float(sum(1 for _, _, a in run["controller"] if a == action))


def _decisions_to_floor(run: dict[str, Any], floor: float) -> float | None:
    """Evaluations until the controller first set rho to its floor (``None``: it never did)."""
    for index, (_, rho, _) in enumerate(run["controller"], 1):
        if rho is not None and rho <= floor + 1e-12:
            return float(index)
    return None


def f11(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """The controller against every fixed rho and dense under a 250 -> 25 Mbit/s link change (F7, F9, F11, F12)."""
    matrix = matrices.get("f11_controller")
    if matrix is None or "controller" not in matrix.by:
        return {}
    low, high = matrix.thresholds
    arms = ["dense"] + [name for name, _ in FIXED_RHOS]
    time_means = {name: matrix.estimate(name, time_to(low)).mean for name in arms[1:]}
    reachable = {k: v for k, v in time_means.items() if v is not None}
    best = min(reachable, key=reachable.get) if reachable else None
    floor = next(iter(matrix.by["controller"].values()))["config"]["system"]["controller_rho_min"]
    out: dict[str, Any] = {
        "seeds": len(matrix.seeds),
        "thresholds": [low, high],
        "best_fixed": best,
        "floor": floor,
        "arms": {},
        "vs": {},
    }
    for name in arms + ["controller", "controller_persistent"]:
        out["arms"][name] = {
            "time_to_target_s": {str(t): _e(matrix.estimate(name, time_to(t))) for t in (low, high)},
            "reached": {str(t): matrix.reached(name, time_to(t)) for t in (low, high)},
            "bytes_mb": _e(matrix.estimate(name, lambda run: bytes_sent(run) / 1e6)),
            "final_accuracy": _e(matrix.estimate(name, final_accuracy)),
            "train_time_s": _e(matrix.estimate(name, train_time)),
        }
    for other in arms:
        out["vs"][other] = {
            "time_to_target_speedup": {
                str(t): _e(matrix.paired("controller", other, time_to(t), "ratio")) for t in (low, high)
            },
            "bytes_ratio": _e(matrix.paired(other, "controller", bytes_sent, "ratio")),
            "accuracy_difference": _e(matrix.paired(other, "controller", final_accuracy)),
            "auc_difference": _e(matrix.auc_difference(other, "controller")),
        }
    controller = matrix.by["controller"]
    out["controller"] = {
        "final_rho": _e(matrix.estimate("controller", _final_rho)),
        "compress_more": _e(matrix.estimate("controller", _count("compress_more"))),
        "compress_less": _e(matrix.estimate("controller", _count("compress_less"))),
        "evaluations_to_floor": _e(matrix.estimate("controller", lambda run: _decisions_to_floor(run, floor))),
        "reached_floor": f"{sum(_decisions_to_floor(r, floor) is not None for r in controller.values())}/{len(controller)}",
    }
    out["persistence"] = {
        "held": _e(matrix.estimate("controller_persistent", _count("hold_for_persistence"))),
        "compress_less": _e(matrix.estimate("controller_persistent", _count("compress_less"))),
        "engaged_runs": sum(
            1 for run in matrix.by.get("controller_persistent", {}).values() if _count("hold_for_persistence")(run)
        ),
        "runs": len(matrix.by.get("controller_persistent", {})),
        "time_to_target_ratio": _e(matrix.paired("controller", "controller_persistent", time_to(low), "ratio")),
        "final_accuracy_difference": _e(matrix.paired("controller", "controller_persistent", final_accuracy)),
        "bytes_ratio": _e(matrix.paired("controller", "controller_persistent", bytes_sent, "ratio")),
    }
    out["aa"] = {
        "time_to_target_ratio": _e(matrix.paired("rho25", "rho25_aa", time_to(low), "ratio")),
        "final_accuracy_difference": _e(matrix.paired("rho25", "rho25_aa", final_accuracy)),
    }
    return out


def realtime(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """The real-clock confirmations beside the same arms in virtual time (F1 at 3 workers, F8 at 250 Mbit/s)."""
    out: dict[str, Any] = {}
    real, virtual = matrices.get("realtime_f1"), matrices.get("f1_stragglers")
    if real is not None and virtual is not None:
        low = real.thresholds[0]
        out["F1"] = {
            "seeds": len(real.seeds),
            "threshold": low,
            "virtual_seeds": len(virtual.seeds),
            "throughput_ratio": {
                "real": _e(real.paired("sync", "async_plain", throughput, "ratio")),
                "virtual": _e(virtual.paired("sync", "async_plain", throughput, "ratio")),
            },
            "time_to_target_speedup": {
                "real": _e(real.paired("async_plain", "sync", time_to(low), "ratio")),
                "virtual": _e(virtual.paired("async_plain", "sync", time_to(low), "ratio")),
            },
            "reached": {
                "real": {"sync": real.reached("sync", time_to(low)), "async": real.reached("async_plain", time_to(low))}
            },
            "sync_throughput": {
                "real": _e(real.estimate("sync", throughput)),
                "virtual": _e(virtual.estimate("sync", throughput)),
            },
            "async_throughput": {
                "real": _e(real.estimate("async_plain", throughput)),
                "virtual": _e(virtual.estimate("async_plain", throughput)),
            },
        }
    real, virtual = matrices.get("realtime_f8"), matrices.get("f8_bandwidth")
    if real is not None and virtual is not None:
        low = real.thresholds[0]
        out["F8"] = {
            "seeds": len(real.seeds),
            "threshold": low,
            "virtual_seeds": len(virtual.seeds),
            "time_to_target_speedup": {
                "real": _e(real.paired("up250_topk25", "up250_dense", time_to(low), "ratio")),
                "virtual": _e(virtual.paired("up250_topk25", "up250_dense", time_to(low), "ratio")),
            },
            "reached": {
                "real": {
                    "dense": real.reached("up250_dense", time_to(low)),
                    "compressed": real.reached("up250_topk25", time_to(low)),
                }
            },
            "per_step_ceiling": {
                "real": _e(real.paired("up250_topk25", "up250_dense", per_step_s, "ratio")),
                "virtual": _e(virtual.paired("up250_topk25", "up250_dense", per_step_s, "ratio")),
            },
            "throughput_ratio": {
                "real": _e(real.paired("up250_dense", "up250_topk25", throughput, "ratio")),
                "virtual": _e(virtual.paired("up250_dense", "up250_topk25", throughput, "ratio")),
            },
        }
    return out


def provenance(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """Per matrix: runs, seeds, commits, clocks, the load average range and the wall seconds the runs took."""
    out = {}
    for name, matrix in matrices.items():
        experiments = [run["experiment"] for run in matrix.runs]
        loads = [
            x
            for e in experiments
            for x in (e.get("load_average_start") or [None])[:1] + (e.get("load_average_end") or [None])[:1]
            if x is not None
        ]
        out[name] = {
            "runs": len(matrix.runs),
            "configurations": len(matrix.by),
            "seeds": len(matrix.seeds),
            "commits": sorted({str(e.get("commit"))[:10] for e in experiments}),
            "dirty": any(e.get("dirty") for e in experiments),
            "clocks": sorted({str(e.get("clock")) for e in experiments}),
            "load_1min": [min(loads), max(loads)] if loads else None,
            "wall_s": sum(e.get("wall_time_s", 0.0) for e in experiments),
        }
    return out


def compute(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every figure of docs/findings.md from the matrices' records (``{matrix name: record}``)."""
    matrices = {name: Matrix(record) for name, record in records.items() if name in MATRICES or name in REALTIME}
    return {
        "F1": f1(matrices),
        "F3": f3(matrices),
        "F2_F4_F5_F6": f2(matrices),
        "F8_F9_F10": f8(matrices),
        "F7_F11_F12": f11(matrices),
        "realtime": realtime(matrices),
        "provenance": provenance(matrices),
    }


# ----------------------------------------------------------------------------- Markdown


def fmt(value: dict[str, Any] | None, digits: int = 2, suffix: str = "", scale: float = 1.0) -> str:
    """``mean [low, high]`` of an estimate dict (``-`` when it has no values; one value: no interval)."""
    if not value or value.get("mean") is None:
        return "-"
    mean, low, high = (None if v is None else v * scale for v in (value["mean"], value["low"], value["high"]))
    if value["n"] == 1 or math.isclose(low, high, rel_tol=0, abs_tol=0.5 * 10**-digits):
        interval = "" if value["n"] == 1 else " (all seeds)"
        return f"{mean:.{digits}f}{suffix}{interval}"
    return f"{mean:.{digits}f}{suffix} [{low:.{digits}f}, {high:.{digits}f}]"


def points(value: dict[str, Any] | None) -> str:
    """An accuracy difference in percentage points."""
    return fmt(value, 2, " pts", 100.0)


def verdict(value: dict[str, Any] | None, target: float, *, above: bool = True) -> str:
    """Whether an estimate meets ``target``: over its whole interval, on its mean only, or not."""
    if not value or value.get("mean") is None:
        return "not measured"
    side = (lambda x: x >= target) if above else (lambda x: x <= target)
    if side(value["low"] if above else value["high"]):
        return "yes"
    return "on the mean, not over the whole interval" if side(value["mean"]) else "no"


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _render_f1(f: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for workers, level in f.items():
        low, high = level["thresholds"]
        lines += [
            f"**{workers} workers** ({level['seeds']} seeds; sync: {fmt(level['sync_throughput'], 0)} samples/s, "
            f"final accuracy {fmt(level['sync_final_accuracy'], 3)}):",
            "",
        ]
        rows = []
        for setup, label in (
            ("async_plain", "plain async (the spec's)"),
            ("async_lookahead", "async, lookahead (ours)"),
        ):
            s = level[setup]
            rows.append(
                [
                    label,
                    fmt(s["throughput_ratio"], 2, "x"),
                    fmt(s["ideal_ratio"], 2, "x"),
                    fmt(s["fraction_of_ideal"], 3),
                    fmt(s["time_to_target_speedup"][str(low)], 2, "x"),
                    fmt(s["time_to_target_speedup"][str(high)], 2, "x"),
                    f"{fmt(s['samples_to_target'][str(high)]['async'], 0)} ({s['samples_to_target'][str(high)]['reached']['async']})"
                    f" vs {fmt(s['samples_to_target'][str(high)]['sync'], 0)} ({s['samples_to_target'][str(high)]['reached']['sync']})",
                    fmt(s["auc_difference"], 3),
                    points(s["final_accuracy_difference"]),
                ]
            )
        lines += _table(
            [
                "async",
                "samples/s over sync",
                "ideal ratio",
                "fraction of ideal",
                f"time to {low:g}: sync/async",
                f"time to {high:g}: sync/async",
                f"samples to {high:g}: async vs sync (reached)",
                "area under accuracy-time, async - sync",
                "final accuracy, async - sync",
            ],
            rows,
        )
        lines += [
            "",
            f"A/A (sync repeated): samples/s ratio {fmt(level['aa']['throughput_ratio'], 3, 'x')}, final accuracy "
            f"{points(level['aa']['final_accuracy_difference'])}.",
            "",
        ]
    return lines


def _render_f3(f: dict[str, Any]) -> list[str]:
    if not f:
        return ["(not measured)"]
    rows = [
        [
            "applied staleness, largest",
            fmt(f["applied_max_staleness"]["plain"], 1),
            fmt(f["applied_max_staleness"]["bounded"], 1),
        ],
        ["pushes rejected", "0", fmt(f["pushes_rejected"], 1)],
        ["final accuracy", fmt(f["final_accuracy"]["plain"], 3), fmt(f["final_accuracy"]["bounded"], 3)],
    ]
    for t, ratio in f["time_to_target_ratio"].items():
        rows.append(
            [
                f"time to {float(t):g} (reached)",
                f"1 ({f['reached'][t]['plain']})",
                f"{fmt(ratio, 2, 'x')} of plain's ({f['reached'][t]['bounded']})",
            ]
        )
    lines = _table(["", "plain async", "soft weight + hard bound S_max = 4"], rows)
    return lines + [
        "",
        f"Bounded over plain ({f['seeds']} seeds, paired): bytes sent {fmt(f['bytes_ratio'], 4, 'x')}, "
        f"final accuracy {points(f['final_accuracy_difference'])}, area under accuracy-time "
        f"{fmt(f['auc_difference'], 3)}.",
    ]


ARM_LABELS = {
    "topk25": "top-k 0.25",
    "topk25_ef": "top-k 0.25 + EF",
    "topk10": "top-k 0.1",
    "topk10_ef": "top-k 0.1 + EF",
    "topk1": "top-k 0.01",
    "topk1_ef": "top-k 0.01 + EF",
    "topk1_ef_warmup": "top-k 0.01 + EF + warm-up",
}


def _render_f2(f: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for optimizer, label in (
        ("sgd", "plain SGD, plain async (the spec's)"),
        ("momentum", "momentum 0.9, lookahead (ours)"),
    ):
        if optimizer not in f:
            continue
        arms = f[optimizer]
        lines += [
            f"**{label}** ({f['seeds']} seeds; dense: final accuracy {fmt(arms['dense']['final_accuracy'], 3)}):",
            "",
        ]
        rows = [
            [
                ARM_LABELS[arm],
                fmt(arms[arm]["bytes_ratio"], 3),
                fmt(arms[arm]["final_accuracy"], 3),
                points(arms[arm]["accuracy_difference"]),
            ]
            for arm in COMPRESSION_ARMS
            if arm in arms
        ]
        rows.append(
            ["dense again (A/A)", fmt(arms["aa"]["bytes_ratio"], 3), "", points(arms["aa"]["accuracy_difference"])]
        )
        lines += _table(["compression", "bytes sent, of dense", "final accuracy", "accuracy - dense"], rows)
        recovered = ", ".join(
            f"rho 0.{rho if rho != '1' else '01'}: {points(value)}" for rho, value in arms["ef_recovers"].items()
        )
        lines += [
            "",
            f"Error feedback recovers (EF - no EF, paired): {recovered}; the warm-up adds "
            f"{points(arms['warmup_adds'])} to top-k 0.01 + EF.",
            "",
        ]
    return lines


def _render_f8(f: dict[str, Any]) -> list[str]:
    if not f:
        return ["(not measured)"]
    low, high = f["thresholds"]
    rows = []
    for value in f["links"].values():
        rows.append(
            [
                value["link"],
                f"{value['rho']:g}",
                fmt(value["bytes_ratio"], 3),
                f"{fmt(value['per_step_s']['dense'], 3)} / {fmt(value['per_step_s']['compressed'], 3)}",
                fmt(value["per_step_ceiling"], 2, "x"),
                fmt(value["throughput_ratio"], 2, "x"),
                f"{fmt(value['time_to_target_speedup'][str(low)], 2, 'x')} ({value['reached'][str(low)]['compressed']})",
                f"{fmt(value['time_to_target_speedup'][str(high)], 2, 'x')} ({value['reached'][str(high)]['compressed']})",
                fmt(value["fraction_of_ceiling"][str(low)], 2),
                points(value["accuracy_difference"]),
            ]
        )
    lines = _table(
        [
            "uplink",
            "rho",
            "bytes, of dense",
            "s per push: dense / top-k",
            "per-step ceiling",
            "samples/s, top-k over dense",
            f"time to {low:g}: dense / top-k (reached)",
            f"time to {high:g}: dense / top-k (reached)",
            f"fraction of the ceiling (to {low:g})",
            "final accuracy, top-k - dense",
        ],
        rows,
    )
    return lines + [
        "",
        f"A/A (250 Mbit/s dense repeated, {f['seeds']} seeds): time to {low:g} ratio "
        f"{fmt(f['aa']['time_to_target_ratio'], 3, 'x')}, final accuracy {points(f['aa']['final_accuracy_difference'])}.",
    ]


def _render_f11(f: dict[str, Any]) -> list[str]:
    if not f:
        return ["(not measured)"]
    low, high = f["thresholds"]
    labels = {
        "dense": "dense",
        "rho25": "fixed 0.25",
        "rho10": "fixed 0.1",
        "rho5": "fixed 0.05",
        "rho1": "fixed 0.01",
        "controller": "controller (0.25, floor 0.05)",
        "controller_persistent": "controller + persistence 2",
    }
    rows = []
    for name, label in labels.items():
        arm = f["arms"][name]
        rows.append(
            [
                label + (" (best fixed)" if name == f["best_fixed"] else ""),
                f"{fmt(arm['time_to_target_s'][str(low)], 2)} ({arm['reached'][str(low)]})",
                f"{fmt(arm['time_to_target_s'][str(high)], 2)} ({arm['reached'][str(high)]})",
                fmt(arm["bytes_mb"], 0),
                fmt(arm["final_accuracy"], 3),
                fmt(arm["train_time_s"], 1),
            ]
        )
    lines = _table(
        ["arm", f"s to {low:g} (reached)", f"s to {high:g} (reached)", "MB sent", "final accuracy", "train s"], rows
    )
    lines += ["", "The controller against each (paired by seed; speed-up = the other's time / the controller's):", ""]
    vs = []
    for name in ("dense", "rho25", "rho10", "rho5", "rho1"):
        value = f["vs"][name]
        vs.append(
            [
                labels[name],
                fmt(value["time_to_target_speedup"][str(low)], 2, "x"),
                fmt(value["time_to_target_speedup"][str(high)], 2, "x"),
                fmt(value["bytes_ratio"], 3),
                points(value["accuracy_difference"]),
                fmt(value["auc_difference"], 3),
            ]
        )
    lines += _table(
        [
            "against",
            f"speed-up to {low:g}",
            f"speed-up to {high:g}",
            "controller's bytes, of its",
            "accuracy, controller - it",
            "area under accuracy-time, controller - it",
        ],
        vs,
    )
    c, p = f["controller"], f["persistence"]
    lines += [
        "",
        f"The controller's path: {fmt(c['compress_more'], 1)} compress-more and {fmt(c['compress_less'], 1)} "
        f"compress-less decisions a run, at its floor ({f['floor']:g}) after {fmt(c['evaluations_to_floor'], 1)} "
        f"evaluations ({c['reached_floor']} runs reached it), final rho {fmt(c['final_rho'], 3)}.",
        "",
        f"Persistence (F12): held a rebound in {p['engaged_runs']} of {p['runs']} runs "
        f"({fmt(p['held'], 2)} holds a run), {fmt(p['compress_less'], 2)} compress-less decisions a run; against "
        f"the controller without it: time to {low:g} ratio {fmt(p['time_to_target_ratio'], 3, 'x')}, bytes "
        f"{fmt(p['bytes_ratio'], 3, 'x')}, final accuracy {points(p['final_accuracy_difference'])}.",
        "",
        f"A/A (fixed 0.25 repeated): time to {low:g} ratio {fmt(f['aa']['time_to_target_ratio'], 3, 'x')}, final accuracy "
        f"{points(f['aa']['final_accuracy_difference'])}.",
    ]
    return lines


def _render_summary(figures: dict[str, Any]) -> list[str]:
    f1_, f2_, f8_, f11_ = figures["F1"], figures["F2_F4_F5_F6"], figures["F8_F9_F10"], figures["F7_F11_F12"]
    rows = []
    for workers in ("3", "16"):
        if workers in f1_:
            s = f1_[workers]["async_plain"]
            rows.append(
                [
                    f"F1 ({workers} workers)",
                    "plain async 10-16x faster than sync",
                    f"plain async {fmt(s['throughput_ratio'], 2, 'x')} the samples/s; ideal {fmt(s['ideal_ratio'], 2, 'x')}; "
                    f"fraction {fmt(s['fraction_of_ideal'], 3)}",
                    ">= 0.9 of the ideal; 10x where the ideal allows",
                    f"0.9 of ideal: {verdict(s['fraction_of_ideal'], 0.9)}; 10x: {verdict(s['throughput_ratio'], 10.0)}",
                ]
            )
    if "sgd" in f2_ and "topk25_ef" in f2_["sgd"]:
        for optimizer in ("sgd", "momentum"):
            arm = f2_[optimizer]["topk25_ef"]
            within = (
                "yes"
                if arm["accuracy_difference"]["low"] is not None and arm["accuracy_difference"]["high"] >= 0
                else "no"
            )
            rows.append(
                [
                    f"F2/F5 ({'plain SGD' if optimizer == 'sgd' else 'momentum 0.9'})",
                    "top-k + EF: <= 50% of the bytes, +0.64 pts",
                    f"top-k 0.25 + EF: {fmt(arm['bytes_ratio'], 3)} of the bytes, {points(arm['accuracy_difference'])}",
                    "<= 50% of the bytes, accuracy within the interval of dense",
                    f"bytes: {verdict(arm['bytes_ratio'], 0.5, above=False)}; accuracy not below dense: {within}",
                ]
            )
    f3_ = figures["F3"]
    if f3_:
        high = next(iter(f3_["time_to_target_ratio"]))
        rows.append(
            [
                "F3 (staleness control)",
                "insurance, not speed: more bytes, slower; applied staleness <= S_max",
                f"bytes {fmt(f3_['bytes_ratio'], 4, 'x')} of plain async's; largest applied staleness "
                f"{fmt(f3_['applied_max_staleness']['bounded'], 0)} against {fmt(f3_['applied_max_staleness']['plain'], 0)}; "
                f"time to {float(high):g} {fmt(f3_['time_to_target_ratio'][high], 2, 'x')} of plain's; final accuracy "
                f"{points(f3_['final_accuracy_difference'])}",
                "-",
                f"more bytes: {verdict(f3_['bytes_ratio'], 1.0)}; slower: {verdict(f3_['time_to_target_ratio'][high], 1.0)}",
            ]
        )
    for optimizer, label in (("sgd", "plain SGD"), ("momentum", "momentum 0.9")):
        arms = f2_.get(optimizer, {})
        if "topk25" in arms:
            rows.append(
                [
                    f"F4 ({label})",
                    "top-k without EF costs accuracy (-0.55 pts Fashion-MNIST, -1.18 CIFAR-10)",
                    f"top-k 0.25 without EF: {points(arms['topk25']['accuracy_difference'])}; 0.01: "
                    f"{points(arms['topk1']['accuracy_difference'])}",
                    "-",
                    f"costs accuracy: {verdict(arms['topk25']['accuracy_difference'], 0.0, above=False)}",
                ]
            )
            rows.append(
                [
                    f"F6 ({label})",
                    "EF recovers ~1.82 pts (CIFAR-10), ~0.6 (Fashion-MNIST)",
                    f"at rho 0.25: {points(arms['ef_recovers']['25'])}; 0.01: {points(arms['ef_recovers']['1'])}",
                    "-",
                    f"recovers: {verdict(arms['ef_recovers']['25'], 0.0)}",
                ]
            )
    if "250" in f8_.get("links", {}):
        link = f8_["links"]["250"]
        low = str(f8_["thresholds"][0])
        rows.append(
            [
                "F8/F9 (250 Mbit/s)",
                "top-k + EF 1.98x faster to target than dense async",
                f"{fmt(link['time_to_target_speedup'][low], 2, 'x')} to {float(low):g} (ceiling {fmt(link['per_step_ceiling'], 2, 'x')})",
                ">= 1.98x, or >= 0.9 of the per-step ceiling where that is lower",
                f"1.98x: {verdict(link['time_to_target_speedup'][low], 1.98)}; 0.9 of the ceiling: "
                f"{verdict(link['fraction_of_ceiling'][low], 0.9)}",
            ]
        )
    if "lan" in f8_.get("links", {}) and "25" in f8_["links"]:
        low = str(f8_["thresholds"][0])
        lan, narrow = f8_["links"]["lan"], f8_["links"]["25"]
        rows.append(
            [
                "F10 (link regimes)",
                "compression pays only when the link is the bottleneck",
                f"top-k 0.25 + EF over dense, time to {float(low):g}: 10 Gbit/s {fmt(lan['time_to_target_speedup'][low], 2, 'x')}, "
                f"250 Mbit/s {fmt(f8_['links']['250']['time_to_target_speedup'][low], 2, 'x')}, "
                f"25 Mbit/s {fmt(narrow['time_to_target_speedup'][low], 2, 'x')}",
                "-",
                f"no gain at 10 Gbit/s: {verdict(lan['time_to_target_speedup'][low], 1.0, above=False)}",
            ]
        )
    if f11_ and f11_["best_fixed"] is not None:
        low = str(f11_["thresholds"][0])
        best = f11_["best_fixed"]
        c, p = f11_["controller"], f11_["persistence"]
        rows.append(
            [
                "F7 (the controller's path)",
                "rho 0.25 -> 0.05 (its floor), no false instability trips",
                f"final rho {fmt(c['final_rho'], 3)}; floor reached in {c['reached_floor']} runs after "
                f"{fmt(c['evaluations_to_floor'], 1)} evaluations; {fmt(c['compress_less'], 2)} compress-less decisions a run",
                "-",
                "-",
            ]
        )
        rows.append(
            [
                "F9 (adaptive vs dense async)",
                "2.6x faster to finish, 3x to 0.80, than plain async",
                f"time to {float(low):g}: {fmt(f11_['vs']['dense']['time_to_target_speedup'][low], 2, 'x')} sooner than dense",
                "-",
                f"faster: {verdict(f11_['vs']['dense']['time_to_target_speedup'][low], 1.0)}",
            ]
        )
        rows.append(
            [
                "F12 (persistence)",
                "never engaged after the rebound fix",
                f"engaged in {p['engaged_runs']} of {p['runs']} runs",
                "-",
                "-",
            ]
        )
        rows.append(
            [
                "F11 (controller, link 250 -> 25 Mbit/s)",
                "3.65x-9x compression; beats the best fixed policy on bytes",
                f"vs best fixed ({best}): {fmt(f11_['vs'][best]['time_to_target_speedup'][low], 2, 'x')} to {float(low):g}, "
                f"{fmt(f11_['vs'][best]['bytes_ratio'], 3)} of its bytes; vs dense: "
                f"{fmt(f11_['vs']['dense']['time_to_target_speedup'][low], 2, 'x')}, {fmt(f11_['vs']['dense']['bytes_ratio'], 3)} of its bytes",
                "against the best fixed rho and dense, with intervals",
                f"faster than the best fixed: {verdict(f11_['vs'][best]['time_to_target_speedup'][low], 1.0)}; "
                f"than dense: {verdict(f11_['vs']['dense']['time_to_target_speedup'][low], 1.0)}",
            ]
        )
    rows.sort(key=lambda row: int(re.match(r"F(\d+)", row[0]).group(1)))  # F1 ... F12 (stable within one)
    return _table(["finding", "spec", "measured here (mean [95% interval] over seeds)", "target", "met"], rows)


def _render_realtime(r: dict[str, Any]) -> list[str]:
    rows = []
    if "F1" in r:
        f = r["F1"]
        rows += [
            [
                "F1, 3 workers, one +0.3 s: plain async samples/s over sync",
                fmt(f["throughput_ratio"]["virtual"], 2, "x"),
                fmt(f["throughput_ratio"]["real"], 2, "x"),
            ],
            ["F1: sync samples/s", fmt(f["sync_throughput"]["virtual"], 0), fmt(f["sync_throughput"]["real"], 0)],
            [
                "F1: plain async samples/s",
                fmt(f["async_throughput"]["virtual"], 0),
                fmt(f["async_throughput"]["real"], 0),
            ],
            [
                f"F1: time to {f['threshold']:g}, sync / async (real: reached sync {f['reached']['real']['sync']}, async "
                f"{f['reached']['real']['async']})",
                fmt(f["time_to_target_speedup"]["virtual"], 2, "x"),
                fmt(f["time_to_target_speedup"]["real"], 2, "x"),
            ],
        ]
    if "F8" in r:
        f = r["F8"]
        rows += [
            [
                "F8, 250 Mbit/s: per-step ceiling, dense / top-k 0.25",
                fmt(f["per_step_ceiling"]["virtual"], 2, "x"),
                fmt(f["per_step_ceiling"]["real"], 2, "x"),
            ],
            [
                "F8: samples/s, top-k 0.25 over dense",
                fmt(f["throughput_ratio"]["virtual"], 2, "x"),
                fmt(f["throughput_ratio"]["real"], 2, "x"),
            ],
            [
                f"F8: time to {f['threshold']:g}, dense / top-k (real: reached dense {f['reached']['real']['dense']}, top-k "
                f"{f['reached']['real']['compressed']})",
                fmt(f["time_to_target_speedup"]["virtual"], 2, "x"),
                fmt(f["time_to_target_speedup"]["real"], 2, "x"),
            ],
        ]
    if not rows:
        return ["(not measured)"]
    seeds = r.get("F1", r.get("F8"))
    return _table(
        ["figure", f"virtual time ({seeds['virtual_seeds']} seeds)", f"real time ({seeds['seeds']} seeds)"], rows
    )


def _render_provenance(p: dict[str, Any]) -> list[str]:
    rows = [
        [
            name,
            str(v["runs"]),
            str(v["configurations"]),
            str(v["seeds"]),
            ", ".join(v["clocks"]),
            ", ".join(v["commits"]) + (" (changes)" if v["dirty"] else ""),
            "-" if v["load_1min"] is None else f"{v['load_1min'][0]:.2f}-{v['load_1min'][1]:.2f}",
            f"{v['wall_s'] / 60:.1f}",
        ]
        for name, v in p.items()
    ]
    return _table(
        ["matrix", "runs", "configurations", "seeds", "clock", "commit", "load (1 min)", "wall minutes"], rows
    )


RENDERERS: dict[str, Callable[[Any], list[str]]] = {
    "F1": _render_f1,
    "F3": _render_f3,
    "F2_F4_F5_F6": _render_f2,
    "F8_F9_F10": _render_f8,
    "F7_F11_F12": _render_f11,
    "realtime": _render_realtime,
    "provenance": _render_provenance,
}


def render(figures: dict[str, Any]) -> dict[str, str]:
    """``{block name: Markdown}`` of every block of docs/findings.md."""
    blocks = {name: "\n".join(RENDERERS[name](figures[name])) for name in RENDERERS}
    blocks["summary"] = "\n".join(_render_summary(figures))
    return blocks


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- findings:{name} -->", f"<!-- /findings:{name} -->"


def check_document(text: str, blocks: dict[str, str]) -> list[str]:
    """One line per block of ``text`` that is missing or differs from ``blocks`` (empty: all agree)."""
    problems = []
    for name, expected in blocks.items():
        begin, end = _markers(name)
        if begin not in text or end not in text:
            problems.append(f"block {name}: missing (markers {begin} ... {end})")
            continue
        found = text.split(begin, 1)[1].split(end, 1)[0].strip("\n")
        if found != expected.strip("\n"):
            problems.append(f"block {name}: differs from what the committed results give")
    return problems


def update_document(text: str, blocks: dict[str, str]) -> str:
    """``text`` with every block's content replaced (each block's markers must be there)."""
    for name, content in blocks.items():
        begin, end = _markers(name)
        if begin not in text or end not in text:
            raise ValueError(f"block {name}: markers {begin} ... {end} not in the document")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{content}\n{end}{tail}"
    return text
