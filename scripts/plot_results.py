"""Plots and a Markdown table of finished experiment runs (headless matplotlib).

    python scripts/plot_results.py --results results/matrix_smoke
    python scripts/plot_results.py --results results/f1 results/f8 --out results/plots

``--results`` takes run folders (holding ``summary.json``, from run_experiment.py) or folders of
them (a matrix, from run_matrix.py); unfinished runs are left out. Everything is read from the runs'
summaries and ``events.jsonl`` files (the source of truth). Written to ``--out`` (default: the
first results folder's ``plots/``):

| file | what |
|---|---|
| ``accuracy_vs_time.png`` | test accuracy against seconds of training (every evaluation) |
| ``accuracy_vs_bytes.png`` | test accuracy against the bytes the workers moved until then (sent + received) |
| ``time_to_target.png`` | time to target accuracy per configuration: mean, spread and each seed |
| ``bytes_per_run.png`` | bytes sent and received per run |
| ``staleness.png`` | staleness histograms of the async runs |
| ``controller.png`` | the adaptive controller's top-k fraction over time (its ``controller`` events) |
| ``results.md`` | a table of every run, and one per configuration over its seeds (mean ± std) |

A configuration is a run name without its ``seed-N`` part (run_matrix.py names runs that way).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parent.parent

PLOTS = ("accuracy_vs_time", "accuracy_vs_bytes", "time_to_target", "bytes_per_run", "staleness", "controller")
SEED_LABEL = re.compile(r"(^|__)seed-\d+(?=__|$)")


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
        return SEED_LABEL.sub("", self.name).strip("_") or self.name

    @property
    def seed(self) -> Any:
        return self.config.get("training", {}).get("seed")


def _events(path: Path) -> Iterable[dict[str, Any]]:
    from src.metrics import read_events

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
        import yaml

        config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    run = Run(path.name, path, summary, config)
    logs = path / "logs"
    server = logs / "server" / "events.jsonl"
    # bytes moved over time: every worker push (its request and reply), by wall time
    moves = sorted((e["time"], e.get("push_bytes", 0) + e.get("reply_bytes", 0))
                   for worker_log in sorted(logs.glob("worker_*/events.jsonl"))
                   for e in _events(worker_log) if e.get("kind") == "push")
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
        candidates = [folder] if (folder / "summary.json").is_file() else sorted(p for p in folder.iterdir() if p.is_dir())
        for candidate in candidates:
            run = load_run(candidate)
            if run is not None:
                runs.append(run)
    return runs


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
    emulation = summary.get("emulation")
    if not emulation:
        return "none"
    parts = []
    for worker, conditions in sorted(emulation.get("workers", {}).items()):
        parts.append(f"w{worker}: " + " ".join(f"{k.replace('_mbps', '')}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}"
                                              for k, v in sorted(conditions.items())))
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
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    return groups


def markdown_table(runs: list[Run]) -> str:
    """Every run, then every configuration over its seeds."""
    lines = ["# Results", "", f"{len(runs)} runs. Times are wall seconds of training (emulated waits included); "
             "bytes are the workers' serialized gRPC messages.", "", "## Runs", "",
             "| run | mode | compression | emulation | seed | final accuracy | train s | target | time to target s "
             "| sent MB | received MB | samples/s | mean staleness | compute ms/step | comm ms/step | ideal async/sync |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s = run.summary
        profile = step_profile(s)
        lines.append("| " + " | ".join([
            run.name, str(s.get("aggregation_mode", s.get("architecture", "-"))), str(s.get("compression", "-")),
            describe_emulation(s), _fmt(run.seed), _fmt(s.get("final_accuracy"), 4), _fmt(s.get("train_time_s", s.get("total_time_s")), 1),
            _fmt(s.get("target_accuracy")), _fmt(s.get("time_to_target_s"), 1), _fmt(s.get("bytes_sent", 0) / 1e6, 1),
            _fmt(s.get("bytes_received", 0) / 1e6, 1), _fmt(s.get("throughput_samples_per_s"), 1), _fmt(s.get("mean_staleness")),
            _fmt(profile["compute_s"] * 1000 if profile["compute_s"] is not None else None, 1),
            _fmt(profile["communication_s"] * 1000 if profile["communication_s"] is not None else None, 1),
            _fmt(profile["ideal_async_over_sync"]),
        ]) + " |")
    lines += ["", "## Configurations (mean ± std over seeds)", "",
              "| configuration | seeds | final accuracy | train s | time to target s (reached/runs) | sent MB | samples/s |",
              "|---|---|---|---|---|---|---|"]
    for group, members in groups_of(runs).items():
        reached = [r.summary["time_to_target_s"] for r in members if r.summary.get("time_to_target_s") is not None]
        lines.append("| " + " | ".join([
            group, str(len(members)),
            _mean_std([r.summary["final_accuracy"] for r in members if r.summary.get("final_accuracy") is not None], 4),
            _mean_std([r.summary.get("train_time_s", r.summary["total_time_s"]) for r in members], 1),
            f"{_mean_std(reached, 1)} ({len(reached)}/{len(members)})",
            _mean_std([r.summary.get("bytes_sent", 0) / 1e6 for r in members], 1),
            _mean_std([r.summary.get("throughput_samples_per_s", 0.0) for r in members], 1),
        ]) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots


def _empty(ax, title: str, why: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=10, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _legend(ax, count: int) -> None:
    if count:
        ax.legend(fontsize=7, loc="best")


def plot_accuracy(ax, runs: list[Run], x_index: int, xlabel: str, title: str) -> None:
    drawn = 0
    for run in runs:
        if run.evals:
            xs = [e[x_index] / (1e6 if x_index == 2 else 1) for e in run.evals]
            ax.plot(xs, [e[1] for e in run.evals], marker=".", label=run.name)
            drawn += 1
    if not drawn:
        _empty(ax, title, "no evaluation events in these runs")
        return
    target = next((r.summary.get("target_accuracy") for r in runs if r.summary.get("target_accuracy")), None)
    if target:
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax, drawn)


def plot_time_to_target(ax, runs: list[Run]) -> None:
    groups = groups_of(runs)
    names = list(groups)
    if not any(r.summary.get("target_accuracy") for r in runs):
        _empty(ax, "Time to target accuracy", "no target accuracy set (training.target_accuracy)")
        return
    for index, name in enumerate(names):
        times = [r.summary.get("time_to_target_s") for r in groups[name]]
        reached = [t for t in times if t is not None]
        if reached:
            mean = statistics.mean(reached)
            ax.bar(index, mean, color="#4c72b0", alpha=0.6)
            ax.errorbar(index, mean, yerr=[[mean - min(reached)], [max(reached) - mean]], color="black", capsize=4)
            ax.scatter([index] * len(reached), reached, color="black", s=12, zorder=3)
        missed = len(times) - len(reached)
        if missed:
            ax.text(index, 0, f"{missed} not\nreached", ha="center", va="bottom", fontsize=7, color="#c44e52")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("seconds to target (mean, min-max, seeds)")
    ax.set_title("Time to target accuracy")
    ax.grid(axis="y", alpha=0.3)


def plot_bytes(ax, runs: list[Run]) -> None:
    names = [r.name for r in runs]
    sent = [r.summary.get("bytes_sent", 0) / 1e6 for r in runs]
    received = [r.summary.get("bytes_received", 0) / 1e6 for r in runs]
    positions = range(len(runs))
    ax.barh([p - 0.2 for p in positions], sent, height=0.4, label="sent (uplink)")
    ax.barh([p + 0.2 for p in positions], received, height=0.4, label="received (downlink)")
    ax.set_yticks(list(positions), names, fontsize=7)
    ax.set_xlabel("MB (serialized gRPC messages)")
    ax.set_title("Bytes per run")
    ax.grid(axis="x", alpha=0.3)
    _legend(ax, len(runs))


def plot_staleness(ax, runs: list[Run]) -> None:
    drawn = 0
    for run in runs:
        histogram = {int(k): v for k, v in (run.summary.get("staleness_histogram") or {}).items()}
        if run.summary.get("aggregation_mode") != "async" or not histogram:
            continue
        total = sum(histogram.values())
        taus = sorted(histogram)
        ax.plot(taus, [histogram[t] / total for t in taus], marker="o", label=run.name)
        drawn += 1
    if not drawn:
        _empty(ax, "Staleness", "no async runs: sync pushes all have staleness 0")
        return
    ax.set_xlabel("staleness tau (server versions)")
    ax.set_ylabel("fraction of pushes")
    ax.set_title("Staleness histograms (async runs)")
    ax.grid(alpha=0.3)
    _legend(ax, drawn)


def plot_controller(ax, runs: list[Run]) -> None:
    drawn = 0
    for run in runs:
        if run.controller:
            ax.step([t for t, _ in run.controller], [rho for _, rho in run.controller], where="post", marker=".", label=run.name)
            drawn += 1
    if not drawn:
        _empty(ax, "Controller decisions", "no controller decisions in these runs\n(experiment.controller off)")
        return
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("top-k fraction rho")
    ax.set_yscale("log")
    ax.set_title("Controller decisions over time")
    ax.grid(alpha=0.3)
    _legend(ax, drawn)


def write_plots(runs: list[Run], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    drawers = {
        "accuracy_vs_time": lambda ax: plot_accuracy(ax, runs, 0, "seconds of training", "Test accuracy vs wall time"),
        "accuracy_vs_bytes": lambda ax: plot_accuracy(ax, runs, 2, "MB moved by the workers (sent + received)",
                                                      "Test accuracy vs bytes"),
        "time_to_target": lambda ax: plot_time_to_target(ax, runs),
        "bytes_per_run": lambda ax: plot_bytes(ax, runs),
        "staleness": lambda ax: plot_staleness(ax, runs),
        "controller": lambda ax: plot_controller(ax, runs),
    }
    written = []
    for name in PLOTS:
        height = max(4.5, 0.35 * len(runs)) if name == "bytes_per_run" else 4.5
        figure, ax = plt.subplots(figsize=(8, height))
        drawers[name](ax)
        figure.tight_layout()
        path = out / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    table = out / "results.md"
    table.write_text(markdown_table(runs))
    written.append(table)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", required=True, help="run folders or folders of runs")
    parser.add_argument("--out", help="output folder (default <first --results>/plots)")
    args = parser.parse_args(argv)
    folders = [Path(p) for p in args.results]
    missing = [str(p) for p in folders if not p.is_dir()]
    if missing:
        print(f"error: --results: not a folder: {', '.join(missing)}", file=sys.stderr)
        return 1
    runs = find_runs(folders)
    if not runs:
        print(f"error: --results: no finished runs in {', '.join(map(str, folders))}", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else folders[0] / "plots"
    for path in write_plots(runs, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
