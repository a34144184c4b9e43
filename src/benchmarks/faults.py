"""Fault tolerance measured: detection latency, time back to full throughput and accuracy against a run
without faults, for a killed worker, a hung worker and a killed server of a local PS job.
``scripts/bench_faults.py`` runs it; its ``--help`` says how each figure is read from the run's events.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from src.benchmarks.common import log

SCENARIOS = {
    "worker_kill": ["kill:worker=1@step=15"],
    "worker_hang": ["hang:worker=1@step=15"],
    "server_kill": ["kill:server@version=40"],
}


def _events(log_dir: Path, *parts: str, kind: str | None = None) -> list[dict]:
    from src.metrics import read_events

    path = log_dir.joinpath(*parts, "events.jsonl")
    return list(read_events(path, kind)) if path.is_file() else []


def _rate_series(updates: list[dict], window_s: float) -> list[tuple[float, float]]:
    """(time, applied samples per second over the window ending then) at each update."""
    points = [(u["time"], sum(len(indices) for _, indices in u["samples"])) for u in updates]
    series = []
    start = 0
    total = 0
    for end, (time_, samples) in enumerate(points):
        total += samples
        while points[start][0] < time_ - window_s:
            total -= points[start][1]
            start += 1
        if time_ - points[0][0] >= window_s:
            series.append((time_, total / window_s))
    return series


def _analyse(log_dir: Path, fault_time: float | None, window_s: float, heartbeat_timeout: float) -> dict:
    updates = _events(log_dir, "server", kind="update")
    result: dict = {}
    failed = _events(log_dir, "server", kind="worker_failed")
    injected = [e for w in range(3) for e in _events(log_dir, f"worker_{w}", kind="fault_injected")]
    if injected:
        fault_time = injected[0]["time"]
        after = [e["time"] for e in failed if e["time"] >= fault_time]
        result["detection_latency_s"] = round(min(after) - fault_time, 3) if after else None
        result["heartbeat_timeout_s"] = heartbeat_timeout
    if fault_time is not None:
        series = _rate_series(updates, window_s)
        before = [rate for time_, rate in series if time_ < fault_time]
        if before:
            normal = statistics.median(before)
            back = next(
                (time_ for time_, rate in series if time_ > fault_time + window_s and rate >= 0.9 * normal), None
            )
            result["throughput_before_samples_per_s"] = round(normal, 1)
            result["time_to_full_throughput_s"] = round(back - fault_time, 2) if back is not None else None
    return result


def run_benchmark(scenarios: list[str], window_s: float, heartbeat_timeout: float) -> dict:
    """The fault-free run, then one run per scenario of ``SCENARIOS`` with the same seed; their figures."""
    from src.common.supervisor import stdout_to_stderr
    from src.config import load_config
    from src.coordinator import check_coverage
    from src.launch.ps import run_local

    results: dict = {
        "setup": "3 workers, sync, mnist_5k (4000 train / 1000 test), 2 epochs, batch 32, momentum 0.9, "
        f"heartbeat interval 0.5 s, timeout {heartbeat_timeout} s, checkpoint every 20 versions"
    }
    with tempfile.TemporaryDirectory() as tmp, stdout_to_stderr():

        def run(name: str, faults: list[str]) -> tuple[dict, Path]:
            log_dir = Path(tmp, name, "logs")
            config = load_config(
                overrides={
                    "training.dataset": "mnist_5k",
                    "training.num_epochs": 2,
                    "training.batch_size": 32,
                    "training.checkpoint_interval": 20,
                    "system.num_workers": 3,
                    "system.aggregation_mode": "sync",
                    "system.heartbeat_interval": 0.5,
                    "system.heartbeat_timeout": heartbeat_timeout,
                    "system.inject_faults": faults,
                    "system.log_dir": str(log_dir),
                    "system.checkpoint_dir": f"{tmp}/{name}/ckpt",
                }
            )
            log(f"bench_faults: {name} {faults}")
            return run_local(config), log_dir

        reference, _ = run("fault_free", [])
        results["fault_free"] = {
            "final_accuracy": reference["final_accuracy"],
            "throughput_samples_per_s": round(reference["throughput_samples_per_s"], 1),
        }
        for name in scenarios:
            summary, log_dir = run(name, SCENARIOS[name])
            server_fault = _events(log_dir, "server", kind="fault_injected")
            fault_time = server_fault[0]["time"] if server_fault else None
            figures = _analyse(log_dir, fault_time, window_s, heartbeat_timeout)
            restarted = _events(log_dir, "launcher", kind="server_restarted")
            if server_fault and restarted:  # a server kill is noticed by the launcher, through the process's exit
                figures["detection_latency_s"] = round(restarted[0]["time"] - fault_time, 3)
            coverage = check_coverage(_events(log_dir, "server"), 4000, 2)
            results[name] = {
                "faults": SCENARIOS[name],
                **figures,
                "final_accuracy": summary["final_accuracy"],
                "accuracy_delta": round(summary["final_accuracy"] - reference["final_accuracy"], 4),
                "throughput_samples_per_s": round(summary["throughput_samples_per_s"], 1),
                "samples_covered_once": coverage["ok"],
                "versions_lost": summary["faults"]["versions_lost"],
                "worker_failures": summary["faults"]["worker_failures"],
            }
    return results
