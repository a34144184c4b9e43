"""Finished experiment runs read back from their folders, and the Markdown table of them.

A run folder (from :mod:`src.launch.experiment`) holds ``summary.json``, ``config.yaml`` and the logs' ``events.jsonl``
files (the source of truth); a matrix (:mod:`src.launch.matrix`) is a folder of them. :func:`find_runs` loads the
finished ones with the series the plots need (:func:`src.reports.plots.write_results` draws them, the command is
``scripts/plot_results.py``), :func:`result_sets` every matrix and the single runs of a results folder (what the
command draws with no ``--results``); :func:`markdown_table` is their table: every run, and every configuration (a
run name without its ``seed-N`` part) over its seeds, mean ± std.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from src.findings.record import configuration_of
from src.metrics import read_events


@dataclass
class Run:
    """One finished run: its summary, config, and the series the plots need."""

    name: str
    path: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    evals: list[tuple[float, float, float]] = field(default_factory=list)
    """(seconds of training, test accuracy, bytes moved by then) per evaluation."""
    controller: list[tuple[float, float]] = field(default_factory=list)
    """(seconds of training, top-k fraction rho) per controller decision."""

    @property
    def group(self) -> str:
        """The configuration: the run's name without its ``seed-N`` part."""
        return configuration_of(self.name)

    @property
    def seed(self) -> Any:
        return self.config.get("training", {}).get("seed")


def _events(path: Path) -> Iterable[dict[str, Any]]:
    return read_events(path) if path.is_file() else ()


def load_run(path: Path) -> Run | None:
    """The run in ``path``, or ``None`` if it is not a finished run."""
    summary_path, status_path = path / "summary.json", path / "experiment.json"
    if not summary_path.is_file():
        return None
    if status_path.is_file() and json.loads(status_path.read_text()).get("status") != "finished":
        return None
    summary = json.loads(summary_path.read_text())
    config: dict[str, Any] = {}
    if (path / "config.yaml").is_file():
        config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    run = Run(path.name, path, summary, config)
    logs = path / "logs"
    server = logs / "server" / "events.jsonl"
    # bytes moved over time: every worker push (its request and reply), by wall time
    moves = sorted(
        (e["time"], e.get("push_bytes", 0) + e.get("reply_bytes", 0))
        for worker_log in sorted(logs.glob("worker_*/events.jsonl"))
        for e in _events(worker_log)
        if e.get("kind") == "push"
    )
    update_time = {e["version"]: e["time"] for e in _events(server) if e.get("kind") == "update"}
    train_start = None
    eval_sources = [server] if server.is_file() else sorted(logs.glob("**/events.jsonl"))
    for source in eval_sources:
        for event in _events(source):
            if event.get("kind") == "eval" and event.get("test_accuracy") is not None:
                seconds = event.get("elapsed_s")
                if seconds is None:
                    continue
                when = update_time.get(event.get("step"), event["time"])
                if train_start is None:
                    train_start = when - seconds
                moved = sum(n for t, n in moves if t <= when)
                run.evals.append((float(seconds), float(event["test_accuracy"]), float(moved)))
            elif event.get("kind") == "controller" and event.get("rho") is not None:
                run.controller.append((event["time"], float(event["rho"])))
    run.evals.sort()
    if run.controller:
        start = train_start if train_start is not None else run.controller[0][0]
        run.controller = [(t - start, rho) for t, rho in run.controller]
    return run


def find_runs(folders: Iterable[Path]) -> list[Run]:
    """Finished runs in ``folders`` (run folders, or folders of run folders)."""
    runs = []
    for folder in folders:
        candidates = (
            [folder] if (folder / "summary.json").is_file() else sorted(p for p in folder.iterdir() if p.is_dir())
        )
        for candidate in candidates:
            run = load_run(candidate)
            if run is not None:
                runs.append(run)
    return runs


PLOTS_FOLDER = "plots"
"""Where a folder's plots go (``<matrix>/plots``; under a results folder, its single runs' plots): never a run."""


def is_run_folder(path: Path) -> bool:
    """A folder run_experiment.py made (finished or not), as opposed to a matrix's folder of them."""
    return any((path / name).is_file() for name in ("summary.json", "experiment.json", "config.yaml"))


def result_sets(root: Path) -> list[tuple[Path, list[Run]]]:
    """``[(folder, its finished runs)]`` in a results folder (``--results-dir`` of run_experiment.py and
    run_matrix.py): each matrix folder in it with its runs, in name order, then ``(root, the single runs in it)``.
    Folders holding no finished run (a failed or interrupted one, an earlier ``plots/``) are left out."""
    sets: list[tuple[Path, list[Run]]] = []
    single: list[Run] = []
    for child in sorted(p for p in root.iterdir() if p.is_dir() and p.name != PLOTS_FOLDER):
        if is_run_folder(child):
            run = load_run(child)
            if run is not None:
                single.append(run)
        else:
            runs = find_runs([child])
            if runs:
                sets.append((child, runs))
    if single:
        sets.append((root, single))
    return sets


# ----------------------------------------------------------------------------- derived figures


def worker_rates(summary: dict[str, Any]) -> dict[int, float]:
    """Each worker's own rate: its samples over its busy time (gradient + compression + communication;
    incarnations of one worker id added up)."""
    rates: dict[int, float] = {}
    for w in summary.get("workers", []):
        busy = w["gradient_time_s"] + w["compression_time_s"] + w["communication_time_s"]
        if busy > 0:
            rates[w["worker_id"]] = rates.get(w["worker_id"], 0.0) + w["samples"] / busy
    return rates


def step_profile(summary: dict[str, Any]) -> dict[str, float | None]:
    """Per-step averages over the workers: compute (gradient + compression) and communication seconds,
    and the ideal async/sync throughput ratio of these workers' rates (sum of rates / (N x slowest))."""
    workers = [w for w in summary.get("workers", []) if w.get("steps")]
    if not workers:
        return {"compute_s": None, "communication_s": None, "ideal_async_over_sync": None}
    steps = sum(w["steps"] for w in workers)
    compute = sum(w["gradient_time_s"] + w["compression_time_s"] for w in workers) / steps
    communication = sum(w["communication_time_s"] for w in workers) / steps
    rates = worker_rates(summary)
    ideal = sum(rates.values()) / (len(rates) * min(rates.values())) if rates and min(rates.values()) > 0 else None
    return {"compute_s": compute, "communication_s": communication, "ideal_async_over_sync": ideal}


def describe_emulation(summary: dict[str, Any]) -> str:
    """The run's emulated conditions per worker (``w1: delay=0.05 uplink=10``), ``none`` without any."""
    emulation = summary.get("emulation")
    if not emulation:
        return "none"
    parts = []
    for worker, conditions in sorted(emulation.get("workers", {}).items()):
        parts.append(
            f"w{worker}: "
            + " ".join(
                f"{k.replace('_mbps', '')}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}"
                for k, v in sorted(conditions.items())
            )
        )
    return "; ".join(parts)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _mean_std(values: list[float], digits: int = 2) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def groups_of(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs by configuration (their seeds together), in the order the configurations first appear."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    return groups


def markdown_table(runs: list[Run]) -> str:
    """Every run, then every configuration over its seeds."""
    lines = [
        "# Results",
        "",
        f"{len(runs)} runs. Times are wall seconds of training (emulated waits included); "
        "bytes are the workers' serialized gRPC messages.",
        "",
        "## Runs",
        "",
        "| run | mode | compression | emulation | seed | final accuracy | train s | target | time to target s "
        "| sent MB | received MB | samples/s | mean staleness | compute ms/step | comm ms/step | ideal async/sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = run.summary
        profile = step_profile(s)
        lines.append(
            "| "
            + " | ".join(
                [
                    run.name,
                    str(s.get("aggregation_mode", s.get("architecture", "-"))),
                    str(s.get("compression", "-")),
                    describe_emulation(s),
                    _fmt(run.seed),
                    _fmt(s.get("final_accuracy"), 4),
                    _fmt(s.get("train_time_s", s.get("total_time_s")), 1),
                    _fmt(s.get("target_accuracy")),
                    _fmt(s.get("time_to_target_s"), 1),
                    _fmt(s.get("bytes_sent", 0) / 1e6, 1),
                    _fmt(s.get("bytes_received", 0) / 1e6, 1),
                    _fmt(s.get("throughput_samples_per_s"), 1),
                    _fmt(s.get("mean_staleness")),
                    _fmt(profile["compute_s"] * 1000 if profile["compute_s"] is not None else None, 1),
                    _fmt(profile["communication_s"] * 1000 if profile["communication_s"] is not None else None, 1),
                    _fmt(profile["ideal_async_over_sync"]),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "## Configurations (mean ± std over seeds)",
        "",
        "| configuration | seeds | final accuracy | train s | time to target s (reached/runs) | sent MB | samples/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for group, members in groups_of(runs).items():
        reached = [r.summary["time_to_target_s"] for r in members if r.summary.get("time_to_target_s") is not None]
        lines.append(
            "| "
            + " | ".join(
                [
                    group,
                    str(len(members)),
                    _mean_std(
                        [r.summary["final_accuracy"] for r in members if r.summary.get("final_accuracy") is not None], 4
                    ),
                    _mean_std([r.summary.get("train_time_s", r.summary["total_time_s"]) for r in members], 1),
                    f"{_mean_std(reached, 1)} ({len(reached)}/{len(members)})",
                    _mean_std([r.summary.get("bytes_sent", 0) / 1e6 for r in members], 1),
                    _mean_std([r.summary.get("throughput_samples_per_s", 0.0) for r in members], 1),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"
