"""The spec's findings (docs/findings.md) computed from the matrices that measure them.

    python scripts/findings.py --results results            # after the matrices in docs/findings.md

Reads ``<results>/f1_stragglers``, ``f8_bandwidth``, ``f2_f6_compression`` and ``f6_error_feedback``
(whichever exist) and prints one JSON document: per finding, each seed's figures, their mean and
standard deviation, the spec's figure and the issue's target beside ours. Nothing is estimated: every number comes from
the runs' summaries (see plot_results.step_profile for the per-step times).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot_results as pr  # noqa: E402  (scripts/ beside this file)


def _stats(values: list[float]) -> dict[str, Any]:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": values}


def _by_seed(runs: list[pr.Run]) -> dict[str, dict[Any, pr.Run]]:
    """{configuration: {seed: run}}"""
    table: dict[str, dict[Any, pr.Run]] = {}
    for run in runs:
        table.setdefault(run.group, {})[run.seed] = run
    return table


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def f1(folder: Path) -> dict[str, Any]:
    table = _by_seed(pr.find_runs([folder]))
    sync = next(v for k, v in table.items() if k.startswith("sync"))
    async_ = next(v for k, v in table.items() if k.startswith("async"))
    seeds = sorted(set(sync) & set(async_))
    throughput, ideal, fraction, ttt_sync, ttt_async, faster, slowest = [], [], [], [], [], [], []
    for seed in seeds:
        s, a = sync[seed].summary, async_[seed].summary
        slowest.append(_ratio(min(pr.worker_rates(a).values()), min(pr.worker_rates(s).values())))
        ratio = _ratio(a["throughput_samples_per_s"], s["throughput_samples_per_s"])
        best = pr.step_profile(a)["ideal_async_over_sync"]
        throughput.append(ratio)
        ideal.append(best)
        fraction.append(_ratio(ratio, best))
        ttt_sync.append(s["time_to_target_s"])
        ttt_async.append(a["time_to_target_s"])
        faster.append(a["time_to_target_s"] is not None and (s["time_to_target_s"] is None or a["time_to_target_s"] < s["time_to_target_s"]))
    return {
        "seeds": seeds,
        "async_over_sync_throughput": _stats(throughput),
        "ideal_ratio": _stats(ideal),
        "fraction_of_ideal": _stats(fraction),
        "time_to_target_s": {"sync": _stats(ttt_sync), "async": _stats(ttt_async),
                             "target_accuracy": sync[seeds[0]].summary.get("target_accuracy")},
        "async_reaches_target_sooner": faster,
        "slowest_worker_rate_async_over_sync": _stats(slowest),
        "time_to_target_speedup": _stats([_ratio(s, a) for s, a in zip(ttt_sync, ttt_async)]),
        "final_accuracy": {"sync": _stats([sync[x].summary["final_accuracy"] for x in seeds]),
                           "async": _stats([async_[x].summary["final_accuracy"] for x in seeds])},
        "spec": "F1: plain async 10-16x faster than sync under worker compute heterogeneity",
        "target": "async/sync throughput >= 0.9 of the ideal ratio, and the target accuracy sooner",
    }


def _per_step(summary: dict[str, Any]) -> float | None:
    profile = pr.step_profile(summary)
    if profile["compute_s"] is None:
        return None
    return profile["compute_s"] + profile["communication_s"]


def f8(folder: Path) -> dict[str, Any]:
    table = _by_seed(pr.find_runs([folder]))
    links = sorted({name.split("__")[0] for name in table}, key=lambda label: -float(label.split("-")[1]))
    out: dict[str, Any] = {}
    for link in links:
        dense, sparse = table.get(f"{link}__identity", {}), table.get(f"{link}__topk_ef", {})
        seeds = sorted(set(dense) & set(sparse))
        speedup, ceiling, fraction = [], [], []
        for seed in seeds:
            d, s = dense[seed].summary, sparse[seed].summary
            speed = _ratio(d["time_to_target_s"], s["time_to_target_s"])
            limit = _ratio(_per_step(d), _per_step(s))
            speedup.append(speed)
            ceiling.append(limit)
            fraction.append(_ratio(speed, limit))
        profile = lambda runs: {key: _stats([pr.step_profile(runs[x].summary)[key] for x in seeds])  # noqa: E731
                                for key in ("compute_s", "communication_s")}
        out[link] = {
            "seeds": seeds,
            "time_to_target_speedup": _stats(speedup),
            "per_step_ceiling": _stats(ceiling),
            "fraction_of_ceiling": _stats(fraction),
            "time_to_target_s": {"identity": _stats([dense[x].summary["time_to_target_s"] for x in seeds]),
                                 "topk_ef": _stats([sparse[x].summary["time_to_target_s"] for x in seeds])},
            "per_step_s": {"identity": profile(dense), "topk_ef": profile(sparse)},
            "bytes_sent_ratio": _stats([_ratio(sparse[x].summary["bytes_sent"], dense[x].summary["bytes_sent"]) for x in seeds]),
            "accuracy_points_vs_identity": _stats([100 * (sparse[x].summary["final_accuracy"] - dense[x].summary["final_accuracy"])
                                                   for x in seeds]),
            "final_accuracy": {"identity": _stats([dense[x].summary["final_accuracy"] for x in seeds]),
                               "topk_ef": _stats([sparse[x].summary["final_accuracy"] for x in seeds])},
        }
    return {"links": out, "spec": "F8/F9: top-k + EF 1.98x faster to target accuracy than uncompressed async under a 250 Mbps uplink",
            "target": ">= 0.9 of the per-step ceiling (compute + dense send) / (compute + compressed send), "
                      "and >= 1.98x wherever the ceiling allows it"}


def f2_f6(folder: Path) -> dict[str, Any]:
    table = _by_seed(pr.find_runs([folder]))
    identity = table["identity"]
    out: dict[str, Any] = {}
    for name in ("topk", "topk_ef", "quantization"):
        runs = table.get(name, {})
        seeds = sorted(set(runs) & set(identity))
        out[name] = {
            "seeds": seeds,
            "bytes_sent_ratio": _stats([_ratio(runs[x].summary["bytes_sent"], identity[x].summary["bytes_sent"]) for x in seeds]),
            "accuracy_points_vs_identity": _stats([100 * (runs[x].summary["final_accuracy"] - identity[x].summary["final_accuracy"])
                                                   for x in seeds]),
            "final_accuracy": _stats([runs[x].summary["final_accuracy"] for x in seeds]),
        }
    out["identity"] = {"final_accuracy": _stats([r.summary["final_accuracy"] for r in identity.values()])}
    both = sorted(set(table.get("topk", {})) & set(table.get("topk_ef", {})))
    out["f6_error_feedback_recovers_points"] = _stats([100 * (table["topk_ef"][x].summary["final_accuracy"]
                                                              - table["topk"][x].summary["final_accuracy"]) for x in both])
    out["spec"] = ("F2/F5: top-k + EF sends <= 50% of the uncompressed bytes at equal or better accuracy (+0.64 points on "
                   "CIFAR-10 ResNet-18); F6: error feedback recovers ~1.82 points over top-k without it (CIFAR-10)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="results", help="folder holding the findings' matrices (default results)")
    args = parser.parse_args(argv)
    root = Path(args.results)
    report: dict[str, Any] = {}
    for key, folder, compute in (("F1", "f1_stragglers", f1), ("F8_F9", "f8_bandwidth", f8), ("F2_F5_F6", "f2_f6_compression", f2_f6),
                                  ("F6_plain_sgd", "f6_error_feedback", f2_f6)):
        if (root / folder).is_dir() and pr.find_runs([root / folder]):
            report[key] = compute(root / folder)
    if not report:
        print(f"error: --results: no findings matrices with finished runs in {root}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
