"""The spec's findings F1-F12, and F13 (sharded servers) and F14 (the controller on four links), computed from the
committed records of their matrices (docs/findings/*.json).

Each finding is one or two matrices (``configs/experiments/f*.yaml``, virtual time, seed the outer
axis, at least 8 seeds, an A/A arm). :func:`compute` turns their records (:mod:`src.findings.record`,
read as :class:`src.findings.runs.Matrix`) into figures, every comparison paired by seed with a
bootstrap 95% interval (:mod:`src.findings.paired_stats`); the figures of one run are :mod:`src.findings.runs`';
F13's (a sharded parameter server against ring allreduce) are :mod:`src.findings.sharded_ps`'.
:func:`src.findings.render.render` writes the figures as the Markdown blocks of ``docs/findings.md``
and :mod:`src.findings.document` checks or rewrites those blocks.
"""

from __future__ import annotations

from typing import Any, Callable

from src.findings.controller_links import f14
from src.findings.paired_stats import Estimate, estimate, paired, paired_by_seed
from src.findings.runs import (
    MATRICES,
    REALTIME,
    Matrix,
    bytes_sent,
    final_accuracy,
    ideal_ratio,
    per_step_s,
    samples_to,
    throughput,
    time_to,
    train_time,
)
from src.findings.sharded_ps import f13


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
    for name in arms + [c for c in ("controller", "controller_persistent", "controller_rebound") if c in matrix.by]:
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
        "reached_floor": f"{sum(_decisions_to_floor(r, floor) is not None for r in controller.values())}"
        f"/{len(controller)}",
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
    """Per matrix: runs, seeds, commits, clocks, CPU kernels, the load average range and the wall seconds the runs
    took."""
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
            "kernels": sorted({_kernels(e) for e in experiments if "cpu_capability" in e}),
            "load_1min": [min(loads), max(loads)] if loads else None,
            "wall_s": sum(e.get("wall_time_s", 0.0) for e in experiments),
        }
    return out


def _kernels(experiment: dict[str, Any]) -> str:
    """A run's CPU kernels in a few words: torch's capability, AMX where the record names it, torch's version."""
    amx = " with AMX" if "amx" in experiment.get("cpu_isa", "") else ""
    return f"{experiment['cpu_capability']}{amx}, torch {experiment['torch_version']}"


def compute(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every figure of docs/findings.md from the matrices' records (``{matrix name: record}``)."""
    matrices = {name: Matrix(record) for name, record in records.items() if name in MATRICES or name in REALTIME}
    return {
        "F1": f1(matrices),
        "F3": f3(matrices),
        "F2_F4_F5_F6": f2(matrices),
        "F8_F9_F10": f8(matrices),
        "F7_F11_F12": f11(matrices),
        "F13": f13(matrices),
        "F14": f14(matrices),
        "realtime": realtime(matrices),
        "provenance": provenance(matrices),
    }
