"""The committed record of a findings matrix: what each run's figures need, small enough for the repository.

A matrix run by ``scripts/run_matrix.py`` leaves, per run, a folder with its config, experiment
record, summary, events, TensorBoard files and checkpoints (megabytes each). :func:`collect_matrix`
keeps of each run only what :mod:`src.findings.figures` reads (``docs/findings/<matrix>.json``, a few KB a run):

* ``experiment``: the experiment record (status, wall time, load average before and after, clock, commit);
* ``config``: the resolved run config (its output paths dropped);
* ``summary``: the run summary without its per-incarnation ``workers`` list, which is cut to the fields
  the figures use (samples, steps, busy times, bytes);
* ``evals``: every evaluation, ``[samples applied, seconds of training, test accuracy, test loss, version]``;
* ``controller``: every controller decision, ``[version, rho, action]``;
* ``applied_max_staleness``: the largest staleness among the pushes the server applied (the push events);
* ``updates`` (a run with several server shards only): every update, ``[version, seconds]``. Such a run evaluates
  only its final whole model, so :mod:`src.findings.sharded_ps` reads its accuracy at each version from the
  one-server run of the same update.

The events are the server's (``logs/server/events.jsonl``), or a DDP run's own (``logs/events.jsonl``).

    record = collect_matrix(Path("results/f1_stragglers"))     # {"matrix": ..., "runs": [...]}
    write_record(record, Path("docs/findings"))
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from src.metrics import read_events

SEED_LABEL = re.compile(r"(^|__)seed-\d+(?=__|$)")
"""The seed part of a matrix run's name (``seed-3__sync``): the rest names its configuration."""
WORKER_FIELDS = (
    "worker_id",
    "incarnation",
    "samples",
    "steps",
    "gradient_time_s",
    "compression_time_s",
    "communication_time_s",
    "bytes_sent",
    "bytes_received",
    "pushes_rejected",
)
PATH_FIELDS = ("log_dir", "checkpoint_dir")


def configuration_of(run_name: str) -> str:
    """``seed-3__sync`` -> ``sync``: the run's name without its seed level."""
    return SEED_LABEL.sub("", run_name).strip("_") or run_name


def collect_run(run_dir: Path) -> dict[str, Any] | None:
    """The record of one finished run folder (``None``: not finished)."""
    summary_path, status_path = run_dir / "summary.json", run_dir / "experiment.json"
    if not (summary_path.is_file() and status_path.is_file()):
        return None
    experiment = json.loads(status_path.read_text())
    if experiment.get("status") != "finished":
        return None
    summary = json.loads(summary_path.read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for field in PATH_FIELDS:
        config.get("system", {}).pop(field, None)
    summary.pop("checkpoint_path", None)
    summary["workers"] = [{k: w[k] for k in WORKER_FIELDS if k in w} for w in summary.get("workers", [])]
    events = next(
        (
            path
            for path in (run_dir / "logs" / "server" / "events.jsonl", run_dir / "logs" / "events.jsonl")
            if path.is_file()
        ),
        None,
    )
    sharded = (summary.get("placement") or {}).get("num_shards", 1) > 1
    evals, controller, applied, updates = [], [], 0, []
    for event in read_events(events) if events is not None else ():
        kind = event.get("kind")
        if kind == "eval" and event.get("test_accuracy") is not None:
            evals.append(
                [
                    event.get("samples"),
                    event.get("elapsed_s"),
                    event["test_accuracy"],
                    event.get("test_loss"),
                    event.get("step"),
                ]
            )
        elif kind == "controller":
            controller.append([event.get("step"), event.get("rho"), event.get("action")])
        elif kind == "push" and event.get("accepted"):
            applied = max(applied, int(event.get("staleness") or 0))
        elif kind == "update" and sharded:
            updates.append([event.get("version"), event.get("time")])
    return {
        "name": run_dir.name,
        "configuration": configuration_of(run_dir.name),
        "seed": config.get("training", {}).get("seed"),
        "experiment": experiment,
        "config": config,
        "summary": summary,
        "evals": evals,
        "controller": controller,
        "applied_max_staleness": applied,
        **({"updates": updates} if sharded else {}),
    }


def collect_matrix(folder: Path) -> dict[str, Any]:
    """Every finished run of the matrix in ``folder``, in run order (seed, then configuration)."""
    runs = [
        record
        for record in (collect_run(path) for path in sorted(folder.iterdir()) if path.is_dir())
        if record is not None
    ]
    runs.sort(key=lambda r: (r["seed"], r["experiment"].get("started", 0.0)))
    return {"matrix": folder.name, "runs": runs}


def write_record(record: dict[str, Any], out_dir: Path) -> Path:
    """Write ``<out_dir>/<matrix>.json`` (compact JSON: one run per line)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{record['matrix']}.json"
    lines = [json.dumps(run, sort_keys=True, separators=(",", ":")) for run in record["runs"]]
    path.write_text('{"matrix": ' + json.dumps(record["matrix"]) + ', "runs": [\n' + ",\n".join(lines) + "\n]}\n")
    return path


def load_records(folder: Path) -> dict[str, dict[str, Any]]:
    """``{matrix name: record}`` of every ``*.json`` record in ``folder``."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
