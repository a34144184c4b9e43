"""The benchmark suite: every ``scripts/bench_*.py`` run in turn as its own process, each one's JSON kept,
and each figure tabled beside its reference with the ratio and the target the benchmark states.
``scripts/bench_all.py`` runs it; its ``--help`` says what reports/bench.json holds.

Benchmarks run one after another (never side by side: they time the same cores), each with a time limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from src.benchmarks.common import log

ROOT = Path(__file__).resolve().parents[2]
QUICK_ARGS = {
    "bench_baseline": ["--repeats", "1", "--epochs", "1"],
    "bench_compression": ["--sizes", "1000000", "--repeats", "3"],
    "bench_ps": [
        "--sizes-mb",
        "1",
        "4",
        "--repeats",
        "5",
        "--ceiling-clients",
        "4",
        "--ceiling-seconds",
        "2",
        "--num-epochs",
        "1",
        "--training-repeats",
        "1",
        "--shards-seconds",
        "2",
    ],
    "bench_virtual": ["--skip-memory"],
    "bench_rpc_peer": ["--repeats", "1", "--epochs", "1"],
    "bench_ddp": [
        "--repeats",
        "1",
        "--hook-repeats",
        "1",
        "--epochs",
        "1",
        "--cases",
        "allreduce",
        "ring",
        "topk",
        "powersgd_rank2",
        "topk_matched",
    ],
}
COMPRESSION_TARGET = {"size": 11_000_000, "ratio": 5.0}  # bench_compression: sampled top-k >= 5x torch.topk at 11M


def last_json_document(text: str) -> Any:
    """The last JSON object printed on stdout (benchmarks print progress before it on some paths)."""
    decoder = json.JSONDecoder()
    for start in sorted(
        (i for i, ch in enumerate(text) if ch == "{" and (i == 0 or text[i - 1] == "\n")), reverse=True
    ):
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if not text[end:].strip():
            return value
    raise ValueError("no JSON object at the end of its output")


def _row(
    benchmark: str,
    figure: str,
    ours: float | None,
    reference: float | None,
    reference_name: str,
    unit: str,
    ratio: float | None,
    ratio_definition: str | None,
    target: float | None,
    *,
    higher_is_better: bool = True,
    target_text: str | None = None,
) -> dict[str, Any]:
    meets = None
    if target is not None and ratio is not None:
        meets = ratio >= target if higher_is_better else ratio <= target
    return {
        "benchmark": benchmark,
        "figure": figure,
        "ours": ours,
        "reference": reference,
        "reference_name": reference_name,
        "unit": unit,
        "ratio": ratio,
        "ratio_definition": ratio_definition,
        "target": target,
        "target_text": target_text,
        "meets_target": meets,
    }


def figures_baseline(result: dict) -> list[dict]:
    return [
        _row(
            "bench_baseline",
            "baseline trainer samples/s",
            result["trainer_samples_per_s"],
            result["plain_loop_samples_per_s"],
            "plain PyTorch loop",
            "samples/s",
            result["ratio"],
            "ours / reference",
            result.get("target_ratio"),
        )
    ]


def figures_ddp(result: dict) -> list[dict]:
    rows = []
    overhead = result.get("overhead")
    if overhead:
        rows.append(
            _row(
                "bench_ddp",
                "DDP trainer samples/s",
                round(overhead["trainer_samples_per_s"], 1),
                round(overhead["plain_ddp_samples_per_s"], 1),
                "plain DDP loop",
                "samples/s",
                round(overhead["ratio"], 4),
                "ours / reference",
                overhead.get("target_ratio"),
            )
        )
    comparison = result.get("powersgd_vs_topk")
    if comparison:
        topk, powersgd = comparison["topk_error_feedback_same_bytes"], comparison["powersgd_rank2"]
        rows.append(
            _row(
                "bench_ddp",
                "top-k + error feedback accuracy at PowerSGD rank 2's bytes",
                topk["final_accuracy"],
                powersgd["final_accuracy"],
                "PowerSGD rank 2",
                "accuracy",
                round(topk["final_accuracy"] / powersgd["final_accuracy"], 4) if powersgd["final_accuracy"] else None,
                "ours / reference",
                None,
            )
        )
        rows.append(
            _row(
                "bench_ddp",
                "top-k + error feedback train time at PowerSGD rank 2's bytes",
                round(topk["train_time_s"], 3),
                round(powersgd["train_time_s"], 3),
                "PowerSGD rank 2",
                "s",
                round(powersgd["train_time_s"] / topk["train_time_s"], 4),
                "reference / ours (> 1: we are faster)",
                None,
            )
        )
    return rows


def figures_ps(result: dict) -> list[dict]:
    rows = []
    for trip in result.get("round_trips", []):
        if trip["transport"] == "tcp":
            reference, name, ratio, target = (
                trip["raw_tcp_echo_ms"] + trip["optimizer_step_ms"],
                "raw TCP echo + optimizer step",
                trip["limit_ratio"],
                trip["target_limit_ratio"],
            )
        else:
            reference, name, ratio, target = (
                trip["grpc_echo_ms"] + trip["optimizer_step_ms"],
                "raw gRPC echo + optimizer step",
                trip["grpc_limit_ratio"],
                trip["target_grpc_limit_ratio"],
            )
        rows.append(
            _row(
                "bench_ps",
                f"{trip['transport']} push + reply round trip, {trip['model_mb']} MB model",
                trip["ps_round_trip_ms"],
                round(reference, 3),
                name,
                "ms",
                ratio,
                "reference / ours (1 = only moving the bytes and stepping)",
                target,
            )
        )
        if "stepping_echo_ms" in trip:
            rows.append(
                _row(
                    "bench_ps",
                    f"{trip['transport']} round trip against the stepping echo, {trip['model_mb']} MB model",
                    trip["ps_round_trip_ms"],
                    trip["stepping_echo_ms"],
                    "raw TCP echo whose server steps on the pushed bytes",
                    "ms",
                    trip["stepping_echo_ratio"],
                    "reference / ours (1 = a server costing only the bytes and a step on cold tensors)",
                    None,
                )
            )
    for ceiling in result.get("ceiling", []):
        rows.append(
            _row(
                "bench_ps",
                f"{ceiling['transport']} pushes/s into one server ({ceiling['model_mb']} MB model, "
                f"saturated at {ceiling['saturated_at_clients']} clients)",
                ceiling["best_pushes_per_s"],
                ceiling["serial_bound_pushes_per_s"],
                "1 / time a push holds the lock",
                "pushes/s",
                round(ceiling["best_pushes_per_s"] / ceiling["serial_bound_pushes_per_s"], 4)
                if ceiling["serial_bound_pushes_per_s"]
                else None,
                "ours / serial bound",
                None,
            )
        )
    rows += figures_ps_shards(result)
    training = result.get("training") or {}
    ddp = (training.get("ddp_2_ranks") or {}).get("samples_per_s")
    for name, run in training.items():
        if name.startswith("ps_") and ddp:
            rows.append(
                _row(
                    "bench_ps",
                    f"PS {name.removeprefix('ps_')} ({run['transport']}), samples/s",
                    run["samples_per_s"],
                    ddp,
                    "DDP, 2 ranks",
                    "samples/s",
                    round(run["samples_per_s"] / ddp, 4),
                    "ours / reference",
                    run.get("target_ratio_to_ddp"),
                )
            )
    return rows


def figures_ps_shards(result: dict) -> list[dict]:
    """bench_ps's server shards: a follower's link per sync step against the stepping echo, 2 shards against one
    server on loopback, and across namespaces with shaped links."""
    rows = []
    for trip in result.get("shard_round_trips", []):
        rows.append(
            _row(
                "bench_ps",
                f"tcp per-shard round trip (a follower's hold + pull, {trip['shard_mb']} MB of a {trip['model_mb']} MB "
                f"model on 2 shards) against the stepping echo",
                trip["shard_round_trip_ms"],
                trip["stepping_echo_ms"],
                "raw TCP echo whose server steps on the pushed bytes (the follower's)",
                "ms",
                trip["stepping_echo_ratio"],
                "reference / ours (1 = a shard costing only the bytes and a step on cold tensors)",
                trip["target"],
            )
        )
    for entry in result.get("shards", []):
        one, two = entry["rows"][0], entry["rows"][-1]
        rows.append(
            _row(
                "bench_ps",
                f"{entry['transport']} pushes/s into {two['servers']} server shards ({entry['model_mb']} MB model, "
                f"{two['clients']} clients, sync, loopback)",
                two["pushes_per_s"],
                one["pushes_per_s"],
                "one server, plain push",
                "pushes/s",
                entry["ratio_to_one_server"],
                "ours / reference",
                None,
                target_text="none set (servers and clients share 2 cores on loopback)",
            )
        )
    netns = result.get("shards_netns")
    if netns and netns.get("skipped"):
        rows.append(_placeholder("bench_ps", "samples/s with 2 server shards across namespaces", netns["skipped"]))
    elif netns:
        rows.append(
            _row(
                "bench_ps",
                f"samples/s with 2 server shards, each link {netns['link_mbps']:g} Mbit/s (namespaces, tc)",
                netns["two_shards"]["samples_per_s"],
                netns["one_shard"]["samples_per_s"],
                "1 server shard, the same link",
                "samples/s",
                netns["ratio"],
                "ours / reference",
                netns["target_ratio"],
            )
        )
    return rows


def figures_compression(result: dict) -> list[dict]:
    rows = []
    for size, entry in sorted(result.get("sizes", {}).items(), key=lambda item: int(item[0])):
        sampled = entry["topk_sampled_0.01"]["compress_ms"]
        target = COMPRESSION_TARGET["ratio"] if int(size) == COMPRESSION_TARGET["size"] else None
        rows.append(
            _row(
                "bench_compression",
                f"sampled top-k 1% compress, {int(size):,} floats",
                sampled,
                entry["torch_topk_1pct_ms"],
                "torch.topk (selection alone)",
                "ms",
                entry["sampled_topk_speedup"]["compress_vs_torch_topk"],
                "reference / ours (speedup)",
                target,
                target_text=None if target else "stated for 11M floats only",
            )
        )
    return rows


def figures_virtual(result: dict) -> list[dict]:
    rows = []
    for case in ("overhead", "compressed"):
        entry = result.get(case)
        if entry:
            rows.append(
                _row(
                    "bench_virtual",
                    f"virtual-time loop, {entry['workers']} workers, {entry['compression']}",
                    entry["loop_wall_s"],
                    entry["in_run_compute_s"],
                    "its gradients' forward/backward alone",
                    "s",
                    entry["in_run_overhead_ratio"],
                    "ours / reference (the driver's overhead)",
                    1.3 if case == "overhead" else None,
                    higher_is_better=False,
                )
            )
    memory = result.get("memory")
    if memory:
        rows.append(
            _row(
                "bench_virtual",
                f"peak RSS, {memory['workers']} workers of {memory['model_mb']} MB",
                memory["peak_rss_gb"],
                memory["target_gb"],
                "the 8 GB target",
                "GB",
                round(memory["peak_rss_gb"] / memory["target_gb"], 3),
                "ours / target",
                1.0,
                higher_is_better=False,
            )
        )
    return rows


def figures_rpc_peer(result: dict) -> list[dict]:
    """Each of our arms' training samples/s beside the torch.distributed.rpc peer's, per model."""
    rows = []
    for model in result["models"]:
        peer = model["arms"]["torch_rpc_peer"]["samples_per_s"]
        for arm, row in model["arms"].items():
            if arm == "torch_rpc_peer":
                continue
            rows.append(
                _row(
                    "bench_rpc_peer",
                    f"{model['model']} sync training samples/s, {arm}",
                    row["samples_per_s"],
                    peer,
                    "torch.distributed.rpc PS (tutorial design)",
                    "samples/s",
                    row["ratio_to_peer"],
                    "ours / reference",
                    row.get("target_ratio_to_peer"),
                )
            )
    return rows


FIGURES: dict[str, Callable[[dict], list[dict]]] = {
    "bench_virtual": figures_virtual,
    "bench_baseline": figures_baseline,
    "bench_ddp": figures_ddp,
    "bench_ps": figures_ps,
    "bench_compression": figures_compression,
    "bench_rpc_peer": figures_rpc_peer,
}


def discover() -> list[str]:
    return sorted(p.stem for p in (ROOT / "scripts").glob("bench_*.py") if p.stem != "bench_all")


def run_one(name: str, extra: list[str], timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *extra]
    started = time.perf_counter()
    entry: dict[str, Any] = {
        "command": " ".join(["python", f"scripts/{name}.py", *extra]),
        "returncode": None,
        "wall_s": None,
        "result": None,
        "error": None,
    }
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        entry["error"] = f"timed out after {timeout_s:.0f}s"
        return entry
    entry["returncode"], entry["wall_s"] = done.returncode, round(time.perf_counter() - started, 1)
    if done.returncode != 0:
        last_line = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        entry["error"] = f"exited with status {done.returncode}: {last_line}"
        return entry
    try:
        entry["result"] = last_json_document(done.stdout)
    except ValueError as exc:
        entry["error"] = str(exc)
    return entry


def _placeholder(name: str, figure: str, target_text: str) -> dict[str, Any]:
    """A row with no figure: the benchmark failed, or bench_all knows no reference for it."""
    return _row(name, figure, None, None, "", "", None, None, None, target_text=target_text)


def run_all(names: list[str], quick: bool, timeout_s: float) -> tuple[dict[str, Any], list[dict]]:
    """Each benchmark in turn: (name -> its entry, the figures' rows)."""
    results, figures = {}, []
    for name in names:
        extra = QUICK_ARGS.get(name, []) if quick else []
        log(f"{name}: running {' '.join(extra) or '(defaults)'}")
        entry = run_one(name, extra, timeout_s)
        results[name] = entry
        if entry["error"]:
            row = _placeholder(name, "(benchmark failed)", entry["error"])
            figures.append({"benchmark": name, "figure": row["figure"], "error": entry["error"], **row})
            log(f"{name}: FAILED: {entry['error']}")
            continue
        extract = FIGURES.get(name)
        if extract:
            figures += extract(entry["result"])
        else:
            figures.append(_placeholder(name, "(no reference figure known to bench_all)", "see its JSON in results"))
        log(f"{name}: done in {entry['wall_s']}s")
    return results, figures


def table_lines(figures: list[dict]) -> list[str]:
    """One line per figure: its ratio and its target."""
    lines = []
    for row in figures:
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}"
        target = row["target_text"] or ("none set" if row["target"] is None else f">= {row['target']}")
        lines.append(f"{row['benchmark']:<18} {row['figure']:<60} ratio {ratio:>7}  target {target}")
    return lines


def run_suite(names: list[str], quick: bool, timeout_s: float, command: str) -> dict[str, Any]:
    """Run ``names`` in turn; the document reports/bench.json holds (``command`` is recorded in it).

    ``figures`` has one row per figure; ``results`` each benchmark's entry, with its ``error`` when it failed.
    """
    load_before = os.getloadavg()[0]
    results, figures = run_all(names, quick, timeout_s)
    return {
        "command": command,
        "quick": quick,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "generated_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "figures": figures,
        "results": results,
    }
