"""F13: when a sharded parameter server beats ring allreduce, computed from the record of ``f13_shards``.

The matrix (``configs/experiments/f13_shards.yaml``) runs, at 8 workers on 1 Gbit/s links, ring allreduce (DDP),
the sync parameter server split into k = 1, 2, 4, 8 shards (and k = 8 with pipelined replies: the pull overlapping
the push), and the async one with one server; then DDP, sync at k = 8 and async with one worker a straggler (+X
seconds a step). :func:`f13` gives, per arm: samples/s, seconds per
step (training time over DDP's steps or the server's versions; an async version is one worker's push), the
formula's step beside it, time and samples to the two thresholds, final accuracy; and against DDP under the same
straggler, paired by seed: time per sample, PS / DDP (< 1: the PS is faster), and time to target, PS / DDP.

**A sharded run's accuracy curve.** A run with several shards evaluates only its final whole model (mid-run
each shard holds a part). Sync, it makes exactly the update one server makes (the same mean of the same batches,
the same optimizer step), so :func:`sharded_curve` puts the one-server run's evaluations (``sync_k1``, same seed)
at the sharded run's time of each version, when the two runs end on the same model (:func:`same_update`: the
identical final accuracy, the final loss equal up to the order of float sums; how many did is ``same_update``),
and gives no curve otherwise.

**Formulas** (the crossover bench, :mod:`src.benchmarks.ps.crossover`; M the bytes of one push: the run's bytes
sent over its pushes, DDP's gradient bytes; B the link; n workers; k shards; c the compute of a step; X the
straggler's added seconds):

* sync PS, push then pull: ``c + X + 2 max(M/B, n M/(k B))`` (X: the barrier waits for the straggler); with
  pipelined replies (``system.pipelined_replies``), push and pull overlapped, BytePS's: ``c + X + max(M/B, n M/(k B))``;
* ring allreduce: ``c + X + 2 (n-1)/n M/B``;
* async PS, one server: ``max(M/B, server_update_s + server_reply_s)`` per version: its NIC or its CPU, whichever
  binds, once enough workers keep it busy (the straggler does not enter).

The server's own seconds are not in the sync formulas (as in the bench).
"""

from __future__ import annotations

import math
from typing import Any

from src.findings.paired_stats import estimate
from src.findings.runs import Matrix, final_accuracy, samples_to, throughput, time_to

MATRIX = "f13_shards"
REFERENCE = "sync_k1"
"""The one-server sync arm whose evaluations a sharded sync run of the same seed takes (see the module docstring)."""
LEVELS = (
    ("", "ddp", ("sync_k1", "sync_k2", "sync_k4", "sync_k8", "sync_k8_pipelined", "async_k1")),
    ("slow05_", "slow05_ddp", ("slow05_sync_k8", "slow05_async_k1")),
    ("slow2_", "slow2_ddp", ("slow2_sync_k8", "slow2_async_k1")),
)
"""Per straggler level: its arms' prefix, its DDP arm, the parameter-server arms compared with it."""
AA = ("ddp", "ddp_aa")


def _e(value) -> dict[str, Any]:
    return value.as_dict()


def _straggler_s(run: dict[str, Any]) -> float:
    workers = (run["config"].get("emulation") or {}).get("workers") or {}
    return max((float(w.get("step_delay_s") or 0.0) for w in workers.values()), default=0.0)


def _kind(run: dict[str, Any]) -> str:
    system = run["config"]["system"]
    return "ddp" if system.get("architecture") == "ddp" else str(system.get("aggregation_mode"))


def _shards(run: dict[str, Any]) -> int:
    return int(run["config"]["system"].get("num_servers") or 1)


def _pipelined(run: dict[str, Any]) -> bool:
    return bool(run["config"]["system"].get("pipelined_replies"))


def steps(run: dict[str, Any]) -> int:
    """DDP's steps, or the server's versions (sync: rounds of every worker; async: single pushes)."""
    summary = run["summary"]
    return int(summary.get("steps") or summary.get("versions") or 0)


def step_s(run: dict[str, Any]) -> float | None:
    """Seconds of training per step (per version for the parameter server)."""
    count = steps(run)
    return run["summary"]["train_time_s"] / count if count else None


def samples_per_step(run: dict[str, Any]) -> int:
    batch = int(run["config"]["training"]["batch_size"])
    return batch if _kind(run) == "async" else batch * int(run["config"]["system"]["num_workers"])


def push_bytes(run: dict[str, Any]) -> float:
    """M: the bytes of one push (DDP: of the gradient, from its ring bytes per rank and step)."""
    summary = run["summary"]
    if _kind(run) == "ddp":
        n = int(summary["world_size"])
        return summary["bytes_sent_per_rank_per_step"] / (2 * (n - 1) / n)
    return summary["bytes_sent"] / summary["pushes_applied"]


def formula_s(run: dict[str, Any]) -> float:
    """The formula's seconds per step (per version for async) of this run (see the module docstring)."""
    emulation, system = run["config"]["emulation"], run["config"]["system"]
    n, k = int(system["num_workers"]), _shards(run)
    bits = 8 * push_bytes(run)
    link = bits / (float(emulation["uplink_mbps"]) * 1e6)
    server = bits / (float(emulation.get("server_mbps") or emulation["uplink_mbps"]) * 1e6)
    compute = float(emulation["compute_s"]) + _straggler_s(run)
    kind = _kind(run)
    if kind == "ddp":
        return compute + 2 * (n - 1) / n * link
    if kind == "sync":
        return compute + (1 if _pipelined(run) else 2) * max(link, n * server / k)
    return max(server, float(emulation["server_update_s"]) + float(emulation["server_reply_s"]))


def formula_per_sample_s(run: dict[str, Any]) -> float:
    """The formula's seconds per sample: its step over the samples a step takes in."""
    return formula_s(run) / samples_per_step(run)


def byteps_formula_s(run: dict[str, Any]) -> float | None:
    """BytePS's sync step, push and pull overlapped: ``c + X + max(M/B, n M/(k B))``; sync PS only."""
    if _kind(run) != "sync":
        return None
    emulation, system = run["config"]["emulation"], run["config"]["system"]
    n, k = int(system["num_workers"]), _shards(run)
    bits = 8 * push_bytes(run)
    link = bits / (float(emulation["uplink_mbps"]) * 1e6)
    server = bits / (float(emulation.get("server_mbps") or emulation["uplink_mbps"]) * 1e6)
    return float(emulation["compute_s"]) + _straggler_s(run) + max(link, n * server / k)


LOSS_TOLERANCE = 1e-6
"""How far (relative) two final test losses of the same updates may lie apart: the float32 sums of a mean over
workers, or of an update over one shard's slices, are ordered differently (seen: 1e-8 relative)."""


def same_update(run: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Whether two runs ended on the same model: the identical final accuracy (the same test images right) and final
    losses within :data:`LOSS_TOLERANCE` of each other (the same updates up to the order of float sums)."""
    a, b = run["summary"], reference["summary"]
    return a["final_accuracy"] == b["final_accuracy"] and math.isclose(
        a["final_loss"], b["final_loss"], rel_tol=LOSS_TOLERANCE
    )


def sharded_curve(run: dict[str, Any], reference: dict[str, Any]) -> list[list[Any]]:
    """A sharded sync run's evaluations: ``reference``'s (one server, same seed), each at the time this run made
    that version; none when the two runs did not end on the same model or a version is missing."""
    if not same_update(run, reference):
        return []
    at = {version: seconds for version, seconds in run.get("updates", [])}
    curve = []
    for samples, _, accuracy, loss, version in reference["evals"]:
        if version not in at:
            return []
        curve.append([samples, at[version], accuracy, loss, version])
    return curve


def _with_curves(matrix: Matrix) -> tuple[Matrix, dict[str, str]]:
    """The matrix with every sharded sync run's curve read from the reference arm, and per such arm how many seeds
    ended on the reference's model (``"8/8"``)."""
    runs, checked = [], {}
    reference = matrix.by.get(REFERENCE, {})
    for run in matrix.runs:
        if "updates" in run and not run["evals"] and _kind(run) == "sync":
            ref = reference.get(run["seed"])
            run = {**run, "evals": sharded_curve(run, ref) if ref is not None else []}
            same = checked.setdefault(run["configuration"], [0, 0])
            same[0] += bool(run["evals"])
            same[1] += 1
        runs.append(run)
    return Matrix({"matrix": matrix.name, "runs": runs}), {name: f"{a}/{b}" for name, (a, b) in checked.items()}


def _arm(matrix: Matrix, name: str, thresholds: tuple[float, float]) -> dict[str, Any]:
    first = next(iter(matrix.by[name].values()))
    return {
        "kind": _kind(first),
        "shards": _shards(first),
        "pipelined": _pipelined(first),
        "straggler_s": _straggler_s(first),
        "samples_per_step": samples_per_step(first),
        "throughput": _e(matrix.estimate(name, throughput)),
        "step_s": _e(matrix.estimate(name, step_s)),
        "formula_s": _e(matrix.estimate(name, formula_s)),
        "byteps_formula_s": _e(matrix.estimate(name, byteps_formula_s)),
        "step_over_formula": _e(estimate([step_s(r) / formula_s(r) for r in matrix.by[name].values()])),
        "push_mb": _e(matrix.estimate(name, lambda run: push_bytes(run) / 1e6)),
        "time_to_target_s": {str(t): _e(matrix.estimate(name, time_to(t))) for t in thresholds},
        "samples_to_target": {str(t): _e(matrix.estimate(name, samples_to(t))) for t in thresholds},
        "reached": {str(t): matrix.reached(name, time_to(t)) for t in thresholds},
        "final_accuracy": _e(matrix.estimate(name, final_accuracy)),
    }


def f13(matrices: dict[str, Matrix]) -> dict[str, Any]:
    """Ring allreduce against the sync PS with 1-8 shards and the async PS with one server, with and without a
    straggler (see the module docstring); ``{}`` when the matrix has no record."""
    matrix = matrices.get(MATRIX)
    if matrix is None or "ddp" not in matrix.by:
        return {}
    matrix, checked = _with_curves(matrix)
    low, high = matrix.thresholds
    first = next(iter(matrix.by["ddp"].values()))
    out: dict[str, Any] = {
        "seeds": len(matrix.seeds),
        "thresholds": [low, high],
        "workers": int(first["config"]["system"]["num_workers"]),
        "link_mbps": float(first["config"]["emulation"]["uplink_mbps"]),
        "same_update": checked,
        "levels": [],
        "arms": {},
        "vs_ddp": {},
    }
    for prefix, ddp, others in LEVELS:
        present = [name for name in (ddp, *others) if name in matrix.by]
        if ddp not in matrix.by:
            continue
        out["levels"].append({"prefix": prefix, "ddp": ddp, "arms": present})
        for name in present:
            out["arms"][name] = _arm(matrix, name, (low, high))
        for name in present[1:]:
            out["vs_ddp"][name] = {
                "ddp": ddp,
                # per seed, (PS seconds per sample) / (DDP's) = DDP's samples/s over the PS's: < 1, the PS is faster
                "time_per_sample_ratio": _e(matrix.paired(name, ddp, throughput, "ratio")),
                "formula_ratio": _e(matrix.paired(ddp, name, formula_per_sample_s, "ratio")),
                "time_to_target_ratio": {
                    str(t): _e(matrix.paired(ddp, name, time_to(t), "ratio")) for t in (low, high)
                },
                "final_accuracy_difference": _e(matrix.paired(ddp, name, final_accuracy)),
            }
    a, b = AA
    out["aa"] = {
        "throughput_ratio": _e(matrix.paired(a, b, throughput, "ratio")),
        "time_to_target_ratio": _e(matrix.paired(a, b, time_to(low), "ratio")),
        "final_accuracy_difference": _e(matrix.paired(a, b, final_accuracy)),
    }
    return out
