"""Consolidated performance report: every architecture's run side by side, as JSON, Markdown and HTML.

Inputs are what the runners already write: run summaries (``summary.json``, or the files
``--artifacts-dir`` writes: ``baseline.json``, ``ps.json``, ``ddp_rank_<r>.json``,
``worker_metrics.json``), ``events.jsonl`` logs (eval curves, staleness, faults) and, optionally,
``reports/bench.json`` from ``scripts/bench_all.py``. The pieces:

* reading (:func:`runs_from_files`, :func:`runs_from_dir`): every file is checked on the way in; a
  missing, malformed or foreign file raises :class:`ReportInputError`, whose text is one line naming
  the file and the problem.
* :func:`build_report`: pure, from :class:`Run` objects to the report dict (the JSON report). Numbers
  are copied from the summaries, never recomputed differently; what a summary lacks is ``None`` and
  rendered as "not recorded". Definitions of throughput, bytes and speedup travel in the report.
* rendering (:func:`write_report`): the JSON, a Markdown page and a self-contained HTML page (plots
  inlined as base64 PNG) beside it, plots drawn by :mod:`src.report_plots` (headless matplotlib).
* :func:`write_artifacts`: what a runner's ``--artifacts-dir`` writes, from the summary it got back
  and its log folder.

Event logs are shared by runs that reuse a log folder (``EventLog`` appends), so a run's events are
cut from its log (:func:`select_run_events`): from just after the previous ``run_end`` of the run's
main log to its last ``run_end``; events of the run's other logs (workers, ranks) in that window.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from src.metrics import SUMMARY_FIELDS, write_summary
from src.report_names import NOT_RECORDED, PLOTS, SECTIONS

REPORT_VERSION = 1
ARCHITECTURES = ("baseline", "parameter_server", "ddp")
ARTIFACT_NAMES = {"baseline": "baseline", "parameter_server": "ps", "ddp": "ddp"}
"""``--artifacts-dir`` file stem of each architecture: ``<stem>.json``, ``<stem>_events.jsonl``."""
WORKER_METRICS_NAME = "worker_metrics.json"
EVENTS_SUFFIX = "_events.jsonl"
FAULT_KINDS = (
    "worker_failed",
    "work_reassigned",
    "worker_restarted",
    "worker_rejoined",
    "server_failed",
    "server_restarted",
    "server_recovered",
    "rank_failed",
    "rank_restarted",
    "checkpoint_failed",
)
_NUMERIC_FIELDS = (
    "final_accuracy",
    "final_loss",
    "total_time_s",
    "throughput_samples_per_s",
    "samples_processed",
    "bytes_sent",
    "bytes_received",
)


def _training_clock(summary: dict[str, Any]) -> str:
    """What a run's training time measures (and, for a virtual-time run, that it was computed, not measured)."""
    clock = summary.get("clock")
    if clock not in (None, "real", "virtual"):
        return clock  # a summary from before the clock field said real or virtual: it held the description
    described = summary.get("training_clock") or _TRAINING_CLOCKS[summary["architecture"]]
    return f"{described}; virtual time, from the cost model" if clock == "virtual" else described


_TRAINING_CLOCKS = {
    "baseline": "the epoch loops only (evaluation and checkpoints excluded)",
    "parameter_server": "from the first worker's registration to the last worker's finish",
    "ddp": "the slowest rank's epoch loops (evaluation and checkpoints excluded)",
}
DEFINITIONS = {
    "throughput": "training samples processed by all workers/ranks together (each sample counted once, by "
    "whoever computed its gradient) divided by the run's training time (train_time_s, the "
    "training clock of the summary). The same figure every runner prints.",
    "speedup": "throughput over the baseline run's throughput in this report (with the same data and epochs "
    "this equals baseline train time / train time).",
    "bytes": "every byte a worker or rank put on the wire (sent) or took off it (received), summed over all "
    "workers/ranks of the run. Parameter server: the serialized gRPC messages (pushes up, parameters "
    "down). DDP: the gradient exchange; measured from what the ring and compression hooks send, "
    "estimated as 2(N-1)/N x gradient bytes per rank for the backend's own allreduce (its traffic "
    "cannot be seen), which the table marks 'estimated'. Baseline: nothing crosses a wire.",
    "bytes_per_step": "bytes one worker/rank sends (receives) for one training step on its batch: total bytes / "
    "(steps of all workers or ranks together).",
    "time_split": "seconds per worker/rank, mean over workers: gradient (forward + backward), compression "
    "(error feedback + compress), communication (push and pull round trips, or the comm hook). "
    "The backend allreduce of DDP overlaps the backward pass and is not separable from it.",
    "exposed_communication": "seconds per worker/rank, mean over workers, that training stood still waiting for "
    "communication (not hidden by computation); its share is of the run's training time. "
    "Parameter server: the worker's time blocked on each push's reply (all of its "
    "communication time: a worker computes nothing meanwhile; in sync mode it includes the "
    "barrier wait). DDP: each step's wait at the end of the backward pass, from the last "
    "gradient computed until every bucket's exchange is done (any allreduce, hook or not). "
    "Baseline: 0, nothing is communicated. See src/exposed_comm.py.",
    "compression_ratio": "uncompressed gradient bytes / bytes of the payloads actually sent (1 = uncompressed).",
    "accuracy_vs_time": "test accuracy of each evaluation event against seconds since the run's run_start "
    "event (its main log): process start-up is included, so the curves share one clock.",
    "time_to_target": "the summary's own time to target accuracy (seconds on its training clock) when it "
    "records one; otherwise the first evaluation at or above --target-accuracy on the "
    "accuracy-vs-wall-time curve.",
    "staleness": "server version at arrival minus the version the worker computed on, per push.",
}


class ReportInputError(ValueError):
    """An input that cannot be used; ``str()`` is one line: the file and the problem."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem


@dataclass
class Run:
    """One training run as the report sees it.

    Attributes:
        summary: the run summary (for DDP given only as rank files, rebuilt by :func:`ddp_summary_from_ranks`).
        origin: the file or folder the run came from.
        workers: per-worker figures of a parameter-server run.
        ranks: per-rank summaries of a DDP run, ordered by rank.
        events: the run's events, each with ``source`` (which log: ``""`` main, ``server``, ``worker_0``...).
        main_source: the ``source`` of the run's main log (where run_start with ``architecture`` is).
    """

    summary: dict[str, Any]
    origin: str
    workers: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    main_source: str | None = None
    label: str = ""
    """Shown in the report; empty: described from the summary (``ps async topk(0.1)``)."""


# ----------------------------------------------------------------------------- reading inputs


def read_json(path: str | Path) -> Any:
    """Parse a JSON file; missing or malformed -> :class:`ReportInputError`."""
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(path, "no such file" if not path.exists() else "not a file")
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ReportInputError(path, "not a text file (expected JSON)") from None
    except json.JSONDecodeError as exc:
        raise ReportInputError(path, f"malformed JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None


def check_summary(path: str | Path, data: Any, expected: str | None = None, *, rank: bool = False) -> dict[str, Any]:
    """Check that ``data`` read from ``path`` is a run summary (``rank``: a DDP per-rank summary).

    Raises:
        ReportInputError: not an object, foreign architecture, missing fields, non-numeric figures.
    """
    if not isinstance(data, dict):
        raise ReportInputError(path, f"not a run summary (a JSON {type(data).__name__}, expected an object)")
    architecture = data.get("architecture")
    if architecture not in ARCHITECTURES:
        raise ReportInputError(
            path,
            f"not a run summary of this project (architecture {architecture!r}, "
            f"expected one of {', '.join(ARCHITECTURES)})",
        )
    if expected is not None and architecture != expected:
        raise ReportInputError(path, f"architecture is {architecture!r}, expected {expected!r}")
    if rank and "rank" not in data:
        raise ReportInputError(
            path, "a run summary, not a per-rank summary (no 'rank' field; ranks are ddp_rank_<r>.json)"
        )
    if not rank and "rank" in data:
        raise ReportInputError(path, f"a per-rank summary (rank {data['rank']}), not a run summary")
    missing = [name for name in SUMMARY_FIELDS if name not in data]
    if missing:
        raise ReportInputError(path, f"summary lacks fields: {', '.join(missing)}")
    for name in _NUMERIC_FIELDS:
        value = data[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ReportInputError(path, f"field {name} is not a number: {value!r}")
    if rank and (isinstance(data["rank"], bool) or not isinstance(data["rank"], int)):
        raise ReportInputError(path, f"field rank is not an integer: {data['rank']!r}")
    return data


def load_summary(path: str | Path, expected: str | None = None) -> dict[str, Any]:
    """A run summary from ``path`` (``expected``: the architecture it must be)."""
    return check_summary(path, read_json(path), expected)


def load_rank_summaries(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """DDP per-rank summaries of one run, ordered by rank; every rank of the run must be there."""
    ranks: dict[int, tuple[Path, dict[str, Any]]] = {}
    for path in map(Path, paths):
        data = check_summary(path, read_json(path), "ddp", rank=True)
        if data["rank"] in ranks:
            raise ReportInputError(path, f"rank {data['rank']} given twice (also {ranks[data['rank']][0]})")
        ranks[data["rank"]] = (path, data)
    first_path, first = ranks[min(ranks)]
    world = first.get("world_size", first["num_workers"])
    for path, data in ranks.values():
        for key in ("world_size", "steps", "epochs", "checkpoint_path"):
            if data.get(key) != first.get(key):
                raise ReportInputError(
                    path, f"from another run than {first_path} ({key} {data.get(key)!r} vs {first.get(key)!r})"
                )
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise ReportInputError(
            first_path,
            f"ranks {', '.join(map(str, missing))} of this {world}-rank run are missing (pass every ddp_rank_<r>.json)",
        )
    return [ranks[r][1] for r in sorted(ranks)]


def load_worker_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Per-worker figures of a parameter-server run (a JSON list of objects with ``worker_id``)."""
    data = read_json(path)
    if not isinstance(data, list) or not all(isinstance(w, dict) for w in data):
        raise ReportInputError(path, "not per-worker metrics (expected a JSON list of objects, one per worker)")
    seen = set()
    for entry in data:
        worker = entry.get("worker_id")
        if isinstance(worker, bool) or not isinstance(worker, int):
            raise ReportInputError(path, f"an entry lacks an integer worker_id: {entry!r:.80}")
        if worker in seen:
            raise ReportInputError(path, f"worker {worker} appears twice")
        seen.add(worker)
    return data


def read_event_file(path: str | Path, source: str | None = None) -> list[dict[str, Any]]:
    """Events of an ``events.jsonl``, each tagged with ``source`` (when given).

    A last line without its newline (a process killed mid-write) is skipped; any other line that is
    not a JSON object with a numeric ``time`` and a string ``kind`` is an error.
    """
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(path, "no such file")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ReportInputError(path, "not a text file (expected JSON lines)") from None
    lines = text.split("\n")
    events = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        torn_tail = number == len(lines)  # text did not end with a newline
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if torn_tail:
                continue
            raise ReportInputError(path, f"line {number} is not JSON (expected one event per line)") from None
        if (
            not isinstance(event, dict)
            or not isinstance(event.get("kind"), str)
            or isinstance(event.get("time"), bool)
            or not isinstance(event.get("time"), (int, float))
        ):
            raise ReportInputError(path, f"line {number} is not an event (needs numeric 'time' and string 'kind')")
        if source is not None:
            event = {**event, "source": source}
        events.append(event)
    return events


def _main_source(events: Iterable[Mapping[str, Any]]) -> str | None:
    """The log holding the run's ``run_start`` with ``architecture`` (baseline/DDP root, PS server)."""
    found = None
    for event in events:
        if event["kind"] == "run_start" and "architecture" in event:
            found = event.get("source", "")
    return found


def select_run_events(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The last complete run's events out of logs that several runs appended to.

    The main log's window runs from just after its previous ``run_end`` to its last ``run_end`` (or
    its end, if it has none). Another log contributes what it wrote after its own last ``run_end``
    before that window and up to the window's end. Events come back sorted by time.
    """
    main = _main_source(events)
    if main is None:
        return sorted((dict(e) for e in events), key=lambda e: e["time"])
    by_source: dict[str, list[Mapping[str, Any]]] = {}
    for event in events:
        by_source.setdefault(event.get("source", ""), []).append(event)
    own = sorted(by_source[main], key=lambda e: e["time"])
    ends = [i for i, e in enumerate(own) if e["kind"] == "run_end"]
    last = ends[-1] if ends else len(own) - 1
    previous = ends[-2] if len(ends) > 1 else -1
    window = own[previous + 1 : last + 1]
    start, end = window[0]["time"], window[-1]["time"]
    selected = list(window)
    for source, logged in by_source.items():
        if source == main:
            continue
        logged = sorted(logged, key=lambda e: e["time"])
        earlier_ends = [e["time"] for e in logged if e["kind"] == "run_end" and e["time"] < start]
        after = earlier_ends[-1] if earlier_ends else -math.inf
        selected += [e for e in logged if after < e["time"] <= end]
    return sorted((dict(e) for e in selected), key=lambda e: e["time"])


def collect_log_events(log_dir: str | Path, *, exclude: Iterable[Path] = ()) -> list[dict[str, Any]]:
    """Every ``events.jsonl`` under ``log_dir`` (tagged with its folder relative to ``log_dir``)."""
    log_dir = Path(log_dir)
    excluded = [Path(p).resolve() for p in exclude]
    events = []
    for path in sorted(log_dir.rglob("events.jsonl")):
        if any(path.resolve().is_relative_to(other) for other in excluded):
            continue
        source = path.parent.relative_to(log_dir).as_posix()
        events += read_event_file(path, "" if source == "." else source)
    return events


def ddp_summary_from_ranks(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's figures from its per-rank summaries, as the DDP trainer forms them.

    Samples and bytes are summed over ranks, the training time is the slowest rank's, total time is
    rank 0's; what every rank shares (accuracy, loss, steps, checkpoint) is taken from rank 0.
    """
    first = ranks[0]
    slowest = max(r["train_time_s"] for r in ranks) if all(r.get("train_time_s") is not None for r in ranks) else None
    samples = sum(r["samples_processed"] for r in ranks)
    sent, received = sum(r["bytes_sent"] for r in ranks), sum(r["bytes_received"] for r in ranks)
    world, steps = len(ranks), first.get("steps_this_run", first.get("steps"))
    summary = {k: v for k, v in first.items() if k not in ("rank", "bytes_sent_per_step", "communication_time_s")}
    summary.update(
        {
            "train_time_s": slowest,
            "throughput_samples_per_s": samples / slowest if slowest else 0.0,
            "samples_processed": samples,
            "bytes_sent": sent,
            "bytes_received": received,
            "bytes_sent_per_rank_per_step": sent / (world * steps) if steps else 0.0,
        }
    )
    for key in ("bytes_sent_measured", "bytes_sent_estimated", "exposed_communication_s"):
        if all(key in r for r in ranks):
            summary[key] = sum(r[key] for r in ranks)
    accountings = {r.get("bytes_accounting") for r in ranks}
    summary["bytes_accounting"] = accountings.pop() if len(accountings) == 1 else "mixed"
    return summary


def _sibling_events(path: Path) -> Path:
    stem = re.sub(r"_rank_\d+$", "", path.stem)
    return path.with_name(stem + EVENTS_SUFFIX)


def _events_beside(path: Path) -> list[dict[str, Any]]:
    events_path = _sibling_events(path)
    return select_run_events(read_event_file(events_path)) if events_path.is_file() else []


def runs_from_files(
    *,
    baseline: str | Path | None = None,
    ps: str | Path | None = None,
    ddp_ranks: Sequence[str | Path] = (),
    worker_metrics: str | Path | None = None,
) -> list[Run]:
    """Runs from the files the spec's flags name; each JSON's events are read from ``<stem>_events.jsonl``
    beside it when that file exists (``--artifacts-dir`` writes it)."""
    runs = []
    if baseline is not None:
        runs.append(Run(load_summary(baseline, "baseline"), str(baseline), events=_events_beside(Path(baseline))))
    if ps is not None:
        summary = load_summary(ps, "parameter_server")
        workers = (
            load_worker_metrics(worker_metrics) if worker_metrics is not None else list(summary.get("workers") or [])
        )
        runs.append(Run(summary, str(ps), workers=workers, events=_events_beside(Path(ps))))
    elif worker_metrics is not None:
        raise ReportInputError(worker_metrics, "per-worker metrics need the parameter server's summary too (--ps-json)")
    if ddp_ranks:
        ranks = load_rank_summaries(ddp_ranks)
        runs.append(
            Run(
                ddp_summary_from_ranks(ranks), str(ddp_ranks[0]), ranks=ranks, events=_events_beside(Path(ddp_ranks[0]))
            )
        )
    for run in runs:
        run.main_source = _main_source(run.events)
    return runs


def runs_from_dir(root: str | Path) -> list[Run]:
    """Every run under ``root``: run summaries (``summary.json`` or any ``*.json`` run summary), DDP rank
    files beside them (or alone: rebuilt into a run), ``worker_metrics.json`` beside a PS summary, and
    every ``events.jsonl`` (or ``<stem>_events.jsonl``) under a run's folder.

    Raises:
        ReportInputError: ``root`` is not a folder, holds no run, or one of its JSON files is malformed.
    """
    root = Path(root)
    if not root.is_dir():
        raise ReportInputError(root, "no such folder" if not root.exists() else "not a folder")
    summaries: list[tuple[Path, dict]] = []
    ranks_by_dir: dict[Path, list[Path]] = {}
    workers_by_dir: dict[Path, Path] = {}
    for path in sorted(root.rglob("*.json")):
        if path.name == WORKER_METRICS_NAME:
            workers_by_dir[path.parent] = path
            continue
        data = read_json(path)
        if not isinstance(data, dict) or "architecture" not in data or "final_accuracy" not in data:
            continue  # other JSON (configs, benchmarks, reports): not ours to judge
        if "rank" in data:
            ranks_by_dir.setdefault(path.parent, []).append(path)
        else:
            summaries.append((path, check_summary(path, data)))
    runs: list[Run] = []
    run_dirs: dict[Path, list[Run]] = {}
    for path, summary in summaries:
        run = Run(summary, str(path))
        if summary["architecture"] == "ddp" and path.parent in ranks_by_dir:
            run.ranks = load_rank_summaries(ranks_by_dir.pop(path.parent))
        if summary["architecture"] == "parameter_server":
            metrics = workers_by_dir.get(path.parent)
            run.workers = load_worker_metrics(metrics) if metrics else list(summary.get("workers") or [])
        runs.append(run)
        run_dirs.setdefault(path.parent, []).append(run)
    for folder, paths in ranks_by_dir.items():  # rank files without their run summary
        ranks = load_rank_summaries(paths)
        run = Run(ddp_summary_from_ranks(ranks), str(paths[0]), ranks=ranks)
        runs.append(run)
        run_dirs.setdefault(folder, []).append(run)
    if not runs:
        raise ReportInputError(root, "no run summaries found (summary.json, baseline.json, ps.json, ddp_rank_<r>.json)")
    _attach_dir_events(root, run_dirs)
    return sorted(
        runs, key=lambda run: ARCHITECTURES.index(run.summary["architecture"])
    )  # stable: path order within one


def _attach_dir_events(root: Path, run_dirs: dict[Path, list[Run]]) -> None:
    """Give each run the events of its folder: a folder of one run takes every events log under it
    (not under a deeper run's folder); a folder of several (an artifacts folder) matches by file name."""
    for folder, runs in run_dirs.items():
        deeper = [other for other in run_dirs if other != folder and other.is_relative_to(folder)]
        if len(runs) == 1:
            events = collect_log_events(folder, exclude=deeper)
            if not events and _sibling_events(Path(runs[0].origin)).is_file():
                events = read_event_file(_sibling_events(Path(runs[0].origin)))
            runs[0].events = select_run_events(events)
        else:
            for run in runs:
                run.events = _events_beside(Path(run.origin))
        for run in runs:
            run.main_source = _main_source(run.events)


# ----------------------------------------------------------------------------- artifacts (runner side)


def write_artifacts(artifacts_dir: str | Path, summary: Mapping[str, Any], log_dir: str | Path) -> list[Path]:
    """Write the report's input files for one run into ``artifacts_dir``; returns what was written.

    ``baseline.json`` / ``ps.json`` (the run summary), ``worker_metrics.json`` (PS workers),
    ``ddp_rank_<r>.json`` (copied from the DDP run's log folder; stale higher ranks removed) and
    ``<stem>_events.jsonl`` (this run's events from every log under ``log_dir``, tagged with the log).
    """
    artifacts_dir = Path(artifacts_dir)
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    architecture, log_dir = summary["architecture"], Path(log_dir)
    stem = ARTIFACT_NAMES[architecture]
    written: list[Path] = []
    if architecture == "ddp":
        world = summary.get("world_size", summary["num_workers"])
        for stale in artifacts_dir.glob("ddp_rank_*.json"):
            stale.unlink()
        for rank in range(world):
            source = log_dir / f"ddp_rank_{rank}.json"
            if source.is_file():  # under torchrun across machines only this machine's ranks are here
                written.append(Path(shutil.copyfile(source, artifacts_dir / source.name)))
    else:
        written.append(write_summary(artifacts_dir / f"{stem}.json", summary))
    if architecture == "parameter_server":
        path = artifacts_dir / WORKER_METRICS_NAME
        path.write_text(json.dumps(summary.get("workers") or [], indent=2) + "\n")
        written.append(path)
    events = select_run_events(collect_log_events(log_dir)) if log_dir.is_dir() else []
    path = artifacts_dir / f"{stem}{EVENTS_SUFFIX}"
    path.write_text("".join(json.dumps(event) + "\n" for event in events))
    written.append(path)
    return written


# ----------------------------------------------------------------------------- building the report (pure)


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _describe(summary: Mapping[str, Any]) -> str:
    """A short run label: ``baseline``, ``ps sync``, ``ps async topk(0.1)``, ``ddp ring``, ``ddp topk``."""
    architecture, compression = summary["architecture"], summary.get("compression") or "none"
    if architecture == "baseline":
        return "baseline"
    if architecture == "parameter_server":
        parts = ["ps", str(summary.get("aggregation_mode", "sync"))]
    else:
        parts = ["ddp", "ring" if summary.get("allreduce") == "ring" else "allreduce"]
    if compression != "none":
        ratio = summary.get("compression_ratio")
        parts.append(
            f"{compression}({ratio:g})"
            if architecture == "ddp" and isinstance(ratio, (int, float))
            else str(compression)
        )
    return " ".join(parts)


def run_labels(runs: Sequence[Run]) -> list[str]:
    """One distinct label per run: its own or :func:`_describe`; repeats get their folder, then a number."""
    described = [run.label or _describe(run.summary) for run in runs]
    labels = list(described)
    for index, run in enumerate(runs):
        folder = Path(run.origin).parent.name
        if described.count(described[index]) > 1 and folder:
            labels[index] = f"{described[index]} [{folder}]"
    with_folders, seen = list(labels), {}
    for index, label in enumerate(with_folders):
        if with_folders.count(label) > 1:
            seen[label] = seen.get(label, 0) + 1
            labels[index] = f"{label} #{seen[label]}"
    return labels


def _main_events(run: Run, kind: str) -> list[dict[str, Any]]:
    return [e for e in run.events if e["kind"] == kind and e.get("source", "") == (run.main_source or "")]


def _run_start_time(run: Run) -> float | None:
    starts = [e["time"] for e in _main_events(run, "run_start")]
    if starts:
        return starts[0]
    return run.events[0]["time"] if run.events else None


def _accuracy_curve(run: Run) -> list[dict[str, Any]]:
    start = _run_start_time(run)
    curve = []
    for event in _main_events(run, "eval"):
        if _number(event.get("test_accuracy")) is None:
            continue
        curve.append(
            {
                "seconds": event["time"] - start,
                "accuracy": event["test_accuracy"],
                "loss": event.get("test_loss"),
                "step": event.get("step"),
                "epoch": event.get("epoch"),
            }
        )
    return curve


def _time_to_target(run: Run, curve: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    s = run.summary
    if s.get("target_accuracy") is not None:
        return {
            "target_accuracy": s["target_accuracy"],
            "seconds": s.get("time_to_target_s"),
            "step": s.get("time_to_target_step"),
            "source": "summary (training clock)",
            "reached": s.get("time_to_target_s") is not None,
        }
    if target is None:
        return {"target_accuracy": None, "seconds": None, "step": None, "source": None, "reached": None}
    hit = next((point for point in curve if point["accuracy"] >= target), None)
    return {
        "target_accuracy": target,
        "seconds": hit["seconds"] if hit else None,
        "step": hit["step"] if hit else None,
        "source": "eval events (seconds since run_start)" if curve else None,
        "reached": (hit is not None) if curve else None,
    }


def _split_value(run: Run, key: str) -> float | None:
    value = _number(run.summary.get(key))
    if value is not None:
        return value
    members = run.workers or run.ranks
    if members and all(_number(m.get(key)) is not None for m in members):
        return sum(float(m[key]) for m in members)
    return None


def _time_split(run: Run) -> dict[str, Any]:
    s = run.summary
    count = len(run.workers) or len(run.ranks) or int(s.get("num_workers") or 1)
    totals = {key: _split_value(run, key) for key in ("gradient_time_s", "compression_time_s", "communication_time_s")}
    note = None
    if (
        s["architecture"] == "ddp"
        and s.get("comm_hook", "allreduce") == "allreduce"
        and s.get("bytes_accounting") == "estimated"
    ):
        totals["communication_time_s"] = None  # the hook timer reads 0: the backend's allreduce runs unseen
        note = (
            "backend allreduce: overlapped with the backward pass, not separable (inside gradient time when recorded)"
        )
    per_worker = {key: (value / count if value is not None else None) for key, value in totals.items()}
    recorded = [v for v in per_worker.values() if v is not None]
    total = sum(recorded) if recorded else None
    shares = {key: (value / total if value is not None and total else None) for key, value in per_worker.items()}
    # Exposed communication is a part of the time above (of communication, or for DDP of the backward
    # pass), so it is not in the shares: its own share is of the training time.
    exposed = 0.0 if s["architecture"] == "baseline" else _split_value(run, "exposed_communication_s")
    exposed_per_worker = exposed / count if exposed is not None else None
    train_time = _number(s.get("train_time_s"))
    return {
        "workers": count,
        "total_s": totals,
        "per_worker_s": per_worker,
        "shares": shares,
        "note": note,
        "exposed_communication_s": exposed_per_worker,
        "exposed_share_of_train_time": exposed_per_worker / train_time
        if exposed_per_worker is not None and train_time
        else None,
    }


def _bytes(run: Run) -> dict[str, Any]:
    s = run.summary
    architecture = s["architecture"]
    sent, received = s["bytes_sent"], s["bytes_received"]
    steps = None
    if architecture == "baseline":
        steps, accounting = s.get("steps"), "none (no communication)"
    elif architecture == "parameter_server":
        if run.workers and all(isinstance(w.get("steps"), int) for w in run.workers):
            steps = sum(w["steps"] for w in run.workers)
        elif s.get("pushes_applied") is not None:
            steps = int(s["pushes_applied"]) + int(s.get("pushes_rejected") or 0)
        accounting = "measured (serialized gRPC messages)"
    else:
        world = s.get("world_size", s["num_workers"])
        per_rank_steps = s.get("steps_this_run", s.get("steps"))
        steps = world * per_rank_steps if per_rank_steps is not None else None
        accounting = str(s.get("bytes_accounting", NOT_RECORDED))
    per_step_sent = s.get("bytes_sent_per_rank_per_step") if architecture == "ddp" else None
    if per_step_sent is None and steps:
        per_step_sent = sent / steps
    notes = {
        "estimated": "estimate: 2(N-1)/N x gradient bytes per rank for the backend allreduce",
        "mixed": "partly estimated (backend allreduce steps) and partly measured (hook payloads)",
    }
    return {
        "sent": sent,
        "received": received,
        "uplink": s.get("uplink_bytes"),
        "downlink": s.get("downlink_bytes"),
        "worker_steps": steps,
        "sent_per_step": per_step_sent,
        "received_per_step": received / steps if steps else None,
        "accounting": accounting,
        "estimated": accounting in ("estimated", "mixed"),
        "note": notes.get(accounting),
    }


def _compression_ratio(run: Run) -> dict[str, Any]:
    s = run.summary
    for key in ("compression_ratio_achieved", "achieved_compression_ratio"):
        if _number(s.get(key)) is not None:
            return {"value": s[key], "source": f"summary ({key})"}
    if (s.get("compression") or "none") == "none":
        return {
            "value": 1.0 if s["architecture"] != "baseline" else None,
            "source": "uncompressed" if s["architecture"] != "baseline" else None,
        }
    last: dict[str, float] = {}
    for event in run.events:  # workers log their cumulative ratio in their train events
        if event["kind"] == "train" and _number(event.get("compression_ratio")) is not None:
            last[event.get("source", "")] = float(event["compression_ratio"])
    if last:
        return {
            "value": sum(last.values()) / len(last),
            "source": "workers' train events (mean of their cumulative ratios)",
        }
    return {"value": None, "source": None}


def _staleness(run: Run) -> dict[str, Any] | None:
    s = run.summary
    if s["architecture"] != "parameter_server":
        return None
    histogram, source = s.get("staleness_histogram"), "summary"
    if not isinstance(histogram, dict):
        counts: dict[str, int] = {}
        for event in _main_events(run, "push"):
            if isinstance(event.get("staleness"), int):
                counts[str(event["staleness"])] = counts.get(str(event["staleness"]), 0) + 1
        histogram, source = (counts, "server push events") if counts else (None, None)
    if histogram is not None:
        histogram = {str(k): int(v) for k, v in sorted(histogram.items(), key=lambda item: int(item[0]))}
    return {
        "mode": s.get("aggregation_mode"),
        "histogram": histogram,
        "source": source,
        "mean": s.get("mean_staleness"),
        "max": s.get("max_staleness"),
        "pushes_rejected": s.get("pushes_rejected"),
    }


def _faults(run: Run) -> dict[str, Any]:
    start = _run_start_time(run)
    events = [e for e in run.events if e["kind"] in FAULT_KINDS]
    timeline = [
        {
            "seconds": e["time"] - start,
            "kind": e["kind"],
            **{k: v for k, v in e.items() if k not in ("time", "kind", "config")},
        }
        for e in events
    ]
    # The server cannot know when a process died, only how long it had been silent when it was failed:
    # that silence is an upper bound of the detection latency (the fault came at or after its last sign of life).
    detections = [
        {"worker": e.get("worker"), "seconds": e.get("detection_latency_s", e.get("silent_for_s"))}
        for e in events
        if e["kind"] == "worker_failed" and _number(e.get("detection_latency_s", e.get("silent_for_s"))) is not None
    ]
    recoveries = []
    for failed in (e for e in events if e["kind"] in ("worker_failed", "rank_failed", "server_failed")):
        who = "worker" if failed["kind"] == "worker_failed" else ("rank" if failed["kind"] == "rank_failed" else None)
        back_kinds = {"worker": ("worker_rejoined",), "rank": ("rank_restarted",), None: ("server_recovered",)}[who]
        back = next(
            (
                e
                for e in events
                if e["kind"] in back_kinds
                and e["time"] >= failed["time"]
                and (who is None or e.get(who) == failed.get(who))
            ),
            None,
        )
        if back is not None:
            recoveries.append(
                {
                    "who": f"{who} {failed.get(who)}" if who else "server",
                    "from": failed["kind"],
                    "to": back["kind"],
                    "seconds": back["time"] - failed["time"],
                }
            )
    for event in events:  # recoveries the event states itself (e.g. a server restarted from its checkpoint)
        for key in ("recovery_s", "recovery_time_s", "downtime_s"):
            if _number(event.get(key)) is not None:
                recoveries.append({"who": event["kind"], "from": None, "to": event["kind"], "seconds": event[key]})
    versions_lost = [e["versions_lost"] for e in events if e["kind"] == "server_recovered" and "versions_lost" in e]
    return {
        "counts": run.summary.get("faults"),
        "timeline": timeline,
        "detection": detections,
        "recovery": recoveries,
        "versions_lost": versions_lost,
        "happened": bool(events)
        or bool(
            isinstance(run.summary.get("faults"), dict) and any(_number(v) for v in run.summary["faults"].values())
        ),
    }


def _table_rows(members: Sequence[Mapping[str, Any]], key: str) -> list[dict[str, Any]]:
    return sorted((dict(m) for m in members), key=lambda m: (m.get(key) is None, m.get(key)))


def build_report(
    runs: Sequence[Run],
    *,
    bench: Mapping[str, Any] | None = None,
    target_accuracy: float | None = None,
    inputs: Sequence[str] = (),
    trace: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report dict (what the JSON report holds) from ``runs``; pure, no I/O.

    Args:
        bench: ``reports/bench.json`` as written by ``scripts/bench_all.py`` (its ``figures`` are tabled).
        target_accuracy: for runs whose summary records no time to target, find it on their eval curve.
        trace: the merged timeline the report links (``file`` beside the report, and
            :func:`src.tracing.describe_trace` of its events), or ``None``.
    """
    labels = run_labels(runs)
    baseline_index = next((i for i, r in enumerate(runs) if r.summary["architecture"] == "baseline"), None)
    baseline = runs[baseline_index] if baseline_index is not None else None
    base_throughput = _number(baseline.summary["throughput_samples_per_s"]) if baseline else None
    entries = []
    for run, label in zip(runs, labels):
        s = run.summary
        throughput = _number(s["throughput_samples_per_s"])
        curve = _accuracy_curve(run)
        entries.append(
            {
                "label": label,
                "origin": run.origin,
                "architecture": s["architecture"],
                "aggregation_mode": s.get("aggregation_mode"),
                "compression": s.get("compression"),
                "comm_hook": s.get("comm_hook"),
                "dataset": s["dataset"],
                "num_workers": s["num_workers"],
                "epochs": s.get("epochs"),
                "steps": s.get("versions", s.get("steps")),
                "final_accuracy": s["final_accuracy"],
                "final_loss": s["final_loss"],
                "total_time_s": s["total_time_s"],
                "train_time_s": s.get("train_time_s"),
                "clock": _training_clock(s),
                "throughput_samples_per_s": s["throughput_samples_per_s"],
                "samples_processed": s["samples_processed"],
                "speedup_vs_baseline": throughput / base_throughput
                if throughput is not None and base_throughput
                else None,
                "time_to_target": _time_to_target(run, curve, target_accuracy),
                "time_split": _time_split(run),
                "bytes": _bytes(run),
                "compression_ratio": _compression_ratio(run),
                "staleness": _staleness(run),
                "faults": _faults(run),
                "emulation": s.get("emulation"),
                "accuracy_curve": curve,
                "events_recorded": bool(run.events),
                "per_worker": _table_rows(run.workers, "worker_id"),
                "per_rank": _table_rows(run.ranks, "rank"),
                "checkpoint_path": s["checkpoint_path"],
            }
        )
    return {
        "report_version": REPORT_VERSION,
        "generated_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "inputs": list(inputs),
        "baseline": labels[baseline_index] if baseline is not None else None,
        "definitions": DEFINITIONS,
        "runs": entries,
        "benchmarks": list(bench.get("figures") or []) if bench else None,
        "benchmark_setup": {k: v for k, v in bench.items() if k != "figures" and k != "results"} if bench else None,
        "plots": {name: f"{name}.png" for name in PLOTS},
        "trace": dict(trace) if trace else None,
    }


# ----------------------------------------------------------------------------- rendering


def _fmt(value: Any, kind: str = "") -> str:
    """A cell: ``None`` -> not recorded; ``pct`` / ``s`` / ``bytes`` / ``x`` / ``rate`` formats."""
    if value is None:
        return NOT_RECORDED
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    if kind == "pct":
        return f"{value * 100:.2f}%"
    if kind == "s":
        return f"{value:.2f} s"
    if kind == "bytes":
        return f"{value:,.0f}"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "rate":
        return f"{value:,.1f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}" if abs(value) >= 10000 else str(value)


Block = tuple  # ("h1"|"h2"|"h3"|"p"|"ul"|"table"|"image", ...)


def report_blocks(report: Mapping[str, Any], plot_dir: str) -> list[Block]:
    """The report as a list of blocks both renderers share (headings, paragraphs, lists, tables, images)."""
    runs = report["runs"]
    blocks: list[Block] = [
        ("h1", "Performance report"),
        (
            "p",
            f"Generated {report['generated_at']} from {len(runs)} run(s): "
            + ", ".join(f"{r['label']} ({r['origin']})" for r in runs)
            + ".",
        ),
    ]

    def image(name: str, caption: str) -> None:
        blocks.append(("image", f"{plot_dir}/{report['plots'][name]}", name, caption))

    blocks += [
        ("h2", SECTIONS[0]),
        ("ul", [f"**{k.replace('_', ' ')}**: {v}" for k, v in report["definitions"].items()]),
    ]

    blocks += [
        ("h2", SECTIONS[1]),
        (
            "table",
            [
                "run",
                "architecture",
                "workers",
                "dataset",
                "epochs",
                "final accuracy",
                "final loss",
                "total time",
                "train time",
                "throughput (samples/s)",
                "speedup vs baseline",
            ],
            [
                [
                    r["label"],
                    r["architecture"],
                    r["num_workers"],
                    r["dataset"],
                    r["epochs"],
                    _fmt(r["final_accuracy"], "pct"),
                    _fmt(r["final_loss"]),
                    _fmt(r["total_time_s"], "s"),
                    _fmt(r["train_time_s"], "s"),
                    _fmt(r["throughput_samples_per_s"], "rate"),
                    _fmt(r["speedup_vs_baseline"], "x") if report["baseline"] else "no baseline run",
                ]
                for r in runs
            ],
        ),
    ]
    blocks.append(("p", "Training clocks: " + "; ".join(f"{r['label']}: {r['clock']}" for r in runs) + "."))
    emulated = [r for r in runs if r["emulation"]]
    if emulated:  # slowed workers or links: the times above are not this machine's own
        blocks.append(
            (
                "p",
                "Emulated conditions: "
                + "; ".join(f"{r['label']}: {json.dumps(r['emulation'], sort_keys=True)}" for r in emulated)
                + ".",
            )
        )

    blocks += [("h2", SECTIONS[2])]
    image("accuracy_vs_time", "Test accuracy against seconds since each run's start")
    blocks.append(
        (
            "table",
            ["run", "evaluations", "first", "last"],
            [
                [
                    r["label"],
                    len(r["accuracy_curve"]),
                    _point(r["accuracy_curve"][0]) if r["accuracy_curve"] else NOT_RECORDED,
                    _point(r["accuracy_curve"][-1])
                    if r["accuracy_curve"]
                    else (NOT_RECORDED + " (no event log)" if not r["events_recorded"] else NOT_RECORDED),
                ]
                for r in runs
            ],
        )
    )

    blocks += [("h2", SECTIONS[3])]
    image("throughput", "Samples per second of training time; the dashed line is the baseline")
    blocks.append(
        (
            "table",
            ["run", "samples processed", "train time", "throughput (samples/s)", "speedup vs baseline"],
            [
                [
                    r["label"],
                    _fmt(r["samples_processed"]),
                    _fmt(r["train_time_s"], "s"),
                    _fmt(r["throughput_samples_per_s"], "rate"),
                    _fmt(r["speedup_vs_baseline"], "x"),
                ]
                for r in runs
            ],
        )
    )

    blocks += [
        ("h2", SECTIONS[4]),
        (
            "table",
            ["run", "target", "time to target", "step", "source"],
            [
                [
                    r["label"],
                    _fmt(r["time_to_target"]["target_accuracy"], "pct"),
                    (
                        "not reached"
                        if r["time_to_target"]["reached"] is False
                        else _fmt(r["time_to_target"]["seconds"], "s")
                    ),
                    "-" if r["time_to_target"]["reached"] is False else _fmt(r["time_to_target"]["step"]),
                    r["time_to_target"]["source"] or "no target set",
                ]
                for r in runs
            ],
        ),
    ]

    blocks += [("h2", SECTIONS[5])]
    image(
        "time_split",
        "Mean seconds per worker/rank in gradient computation, compression and communication, "
        "and the communication not hidden by computation (exposed)",
    )
    blocks.append(
        (
            "table",
            ["run", "workers", "gradient", "compression", "communication", "exposed communication", "note"],
            [
                [r["label"], r["time_split"]["workers"]]
                + [
                    _split_cell(r["time_split"], key)
                    for key in ("gradient_time_s", "compression_time_s", "communication_time_s")
                ]
                + [_exposed_cell(r["time_split"]), r["time_split"]["note"] or ""]
                for r in runs
            ],
        )
    )

    blocks += [("h2", SECTIONS[6])]
    image("bytes_per_step", "Bytes one worker/rank sends and receives per training step (hatched: estimated)")
    blocks.append(
        (
            "table",
            [
                "run",
                "bytes sent",
                "bytes received",
                "uplink",
                "downlink",
                "sent per step",
                "received per step",
                "compression ratio",
                "accounting",
            ],
            [
                [
                    r["label"],
                    _fmt(r["bytes"]["sent"], "bytes"),
                    _fmt(r["bytes"]["received"], "bytes"),
                    _fmt(r["bytes"]["uplink"], "bytes"),
                    _fmt(r["bytes"]["downlink"], "bytes"),
                    _fmt(r["bytes"]["sent_per_step"], "bytes"),
                    _fmt(r["bytes"]["received_per_step"], "bytes"),
                    _fmt(r["compression_ratio"]["value"], "x")
                    if r["compression_ratio"]["value"] is not None
                    else ("n/a" if r["architecture"] == "baseline" else NOT_RECORDED),
                    r["bytes"]["accounting"] + (f" ({r['bytes']['note']})" if r["bytes"]["note"] else ""),
                ]
                for r in runs
            ],
        )
    )

    blocks += [("h2", SECTIONS[7])]
    stale = [r for r in runs if r["staleness"] is not None]
    image("staleness", "Pushes by staleness (versions behind at arrival), per parameter-server run")
    blocks.append(
        (
            "table",
            ["run", "mode", "mean", "max", "pushes rejected", "histogram (staleness: pushes)", "source"],
            [
                [
                    r["label"],
                    r["staleness"]["mode"],
                    _fmt(r["staleness"]["mean"]),
                    _fmt(r["staleness"]["max"]),
                    _fmt(r["staleness"]["pushes_rejected"]),
                    ", ".join(f"{k}: {v}" for k, v in r["staleness"]["histogram"].items())
                    if r["staleness"]["histogram"]
                    else NOT_RECORDED,
                    r["staleness"]["source"] or "",
                ]
                for r in stale
            ],
        )
        if stale
        else ("p", "No parameter-server run: staleness not recorded.")
    )

    blocks += [("h2", SECTIONS[8])]
    image("fault_timeline", "Fault events against seconds since each run's start")
    faulty = [r for r in runs if r["faults"]["happened"]]
    if not faulty:
        blocks.append(("p", "No faults recorded in these runs (no fault events, no fault counts in the summaries)."))
    for r in faulty:
        f = r["faults"]
        blocks.append(("h3", r["label"]))
        if f["counts"]:
            blocks.append(
                ("p", "Counts from the summary: " + ", ".join(f"{k} {v}" for k, v in f["counts"].items()) + ".")
            )
        blocks.append(
            (
                "table",
                ["worker", "detection latency (at most: silence before the failure was declared)"],
                [[d["worker"], _fmt(d["seconds"], "s")] for d in f["detection"]],
            )
            if f["detection"]
            else ("p", "Detection latency: " + NOT_RECORDED + ".")
        )
        blocks.append(
            (
                "table",
                ["who", "from", "to", "recovery time"],
                [[x["who"], x["from"] or "", x["to"], _fmt(x["seconds"], "s")] for x in f["recovery"]],
            )
            if f["recovery"]
            else ("p", "Recovery time: " + NOT_RECORDED + ".")
        )
        if f["versions_lost"]:
            blocks.append(("p", "Server versions lost to recovery: " + ", ".join(map(str, f["versions_lost"])) + "."))
        if f["timeline"]:
            blocks.append(
                (
                    "table",
                    ["time", "event", "details"],
                    [
                        [
                            _fmt(e["seconds"], "s"),
                            e["kind"],
                            ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("seconds", "kind")),
                        ]
                        for e in f["timeline"]
                    ],
                )
            )

    blocks += [("h2", SECTIONS[9])]
    with_workers = [r for r in runs if r["per_worker"]]
    if not with_workers:
        blocks.append(("p", "No per-worker figures (no parameter-server run with worker metrics)."))
    for r in with_workers:
        blocks += [("h3", r["label"]), _member_table(r["per_worker"], "worker_id")]

    blocks += [("h2", SECTIONS[10])]
    with_ranks = [r for r in runs if r["per_rank"]]
    if not with_ranks:
        blocks.append(("p", "No per-rank figures (no DDP run with ddp_rank_<r>.json)."))
    for r in with_ranks:
        blocks += [("h3", r["label"]), _member_table(r["per_rank"], "rank")]

    blocks += [("h2", SECTIONS[11])]
    if report["benchmarks"] is None:
        blocks.append(
            (
                "p",
                "Benchmarks " + NOT_RECORDED + " (run `python scripts/bench_all.py` and pass "
                "`--bench-json reports/bench.json`).",
            )
        )
    else:
        setup = report.get("benchmark_setup") or {}
        if setup:
            blocks.append(
                (
                    "p",
                    "Measured "
                    + ", ".join(f"{k}: {v}" for k, v in setup.items() if not isinstance(v, (dict, list)))
                    + ".",
                )
            )
        blocks.append(
            (
                "table",
                ["benchmark", "figure", "ours", "reference", "ratio", "target", "meets target"],
                [
                    [
                        b.get("benchmark", ""),
                        b.get("figure", ""),
                        _with_unit(b.get("ours"), b.get("unit")),
                        f"{_with_unit(b.get('reference'), b.get('unit'))} ({b.get('reference_name', '')})",
                        _fmt(b.get("ratio")) + (f" ({b['ratio_definition']})" if b.get("ratio_definition") else ""),
                        b.get("target_text") or ("none set" if b.get("target") is None else f">= {b['target']}"),
                        "n/a" if b.get("meets_target") is None else _fmt(b["meets_target"]),
                    ]
                    for b in report["benchmarks"]
                ],
            )
        )

    blocks += [("h2", SECTIONS[12])]
    trace = report.get("trace")
    if not trace:
        blocks.append(
            (
                "p",
                "Timeline " + NOT_RECORDED + " (train with `--trace`, then pass the run's log folder as "
                "`--trace-dir`).",
            )
        )
    else:
        blocks.append(
            (
                "p",
                f"The run's traces merged on one clock: [{trace['file']}]({trace['file']}) "
                f"({len(trace['processes'])} processes, {trace['spans']:,} spans, {_fmt(trace['seconds'], 's')}); "
                "open it in https://ui.perfetto.dev or `chrome://tracing`.",
            )
        )
        blocks.append(
            ("table", ["process", "pid", "spans"], [[p["name"], p["pid"], p["spans"]] for p in trace["processes"]])
        )
        blocks.append(
            (
                "table",
                ["span", "count", "total time", "mean"],
                [
                    [name, n["count"], _fmt(n["seconds"], "s"), _fmt(n["seconds"] / n["count"] * 1000, "") + " ms"]
                    for name, n in trace["names"].items()
                ],
            )
        )
    return blocks


def _with_unit(value: Any, unit: str | None) -> str:
    return _fmt(value) + (f" {unit}" if unit and value is not None else "")


def _point(point: Mapping[str, Any]) -> str:
    return f"{point['accuracy'] * 100:.2f}% at {point['seconds']:.1f} s (step {point['step']})"


def _split_cell(split: Mapping[str, Any], key: str) -> str:
    value, share = split["per_worker_s"][key], split["shares"][key]
    if value is None:
        return NOT_RECORDED
    return f"{value:.3f} s ({share * 100:.0f}%)" if share is not None else f"{value:.3f} s"


def _exposed_cell(split: Mapping[str, Any]) -> str:
    value, share = split["exposed_communication_s"], split["exposed_share_of_train_time"]
    if value is None:
        return NOT_RECORDED
    return f"{value:.3f} s ({share * 100:.0f}% of train time)" if share is not None else f"{value:.3f} s"


_MEMBER_FIRST = (
    "worker_id",
    "rank",
    "samples",
    "samples_processed",
    "steps",
    "train_time_s",
    "total_time_s",
    "throughput_samples_per_s",
    "bytes_sent",
    "bytes_received",
    "gradient_time_s",
    "compression_time_s",
    "communication_time_s",
    "exposed_communication_s",
    "pushes_rejected",
    "train_loss",
    "train_accuracy",
)
_SHARED_RANK_FIELDS = (
    "architecture",
    "dataset",
    "num_workers",
    "world_size",
    "backend",
    "allreduce",
    "comm_hook",
    "compression",
    "compression_ratio",
    "quantization_bits",
    "error_feedback",
    "epochs",
    "final_accuracy",
    "final_loss",
    "checkpoint_path",
    "steps",
    "steps_this_run",
)


def _member_table(members: Sequence[Mapping[str, Any]], key: str) -> Block:
    """One row per worker/rank; scalar columns only (the run's shared fields are in the summary)."""
    skip = _SHARED_RANK_FIELDS if key == "rank" else ()
    columns = [c for c in _MEMBER_FIRST if any(c in m for m in members) and c not in skip]
    columns += sorted(
        {
            c
            for m in members
            for c, v in m.items()
            if c not in columns and c not in skip and not isinstance(v, (dict, list))
        }
    )
    return (
        "table",
        columns,
        [
            [
                _fmt(m.get(c), "bytes" if c.startswith("bytes") and isinstance(m.get(c), (int, float)) else "")
                for c in columns
            ]
            for m in members
        ],
    )


def _md_cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: Sequence[Block]) -> str:
    """Render blocks as GitHub-flavoured Markdown (images link to the PNG files)."""
    out: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + block[1])
        elif kind == "p":
            out.append(block[1])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "table":
            headers, rows = block[1], block[2]
            lines = ["| " + " | ".join(map(_md_cell, headers)) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "image":
            out.append(f"![{block[3]}]({block[1]})")
    return "\n\n".join(out) + "\n"


def _inline_html(text: str) -> str:
    escaped = html.escape(str(text))
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    escaped = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r'<a href="\2">\1</a>', escaped)  # [text](relative link)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f2f2f2}img{max-width:100%;border:1px solid #eee}code{background:#f6f6f6;padding:0 3px}"""


def to_html(blocks: Sequence[Block], images: Mapping[str, bytes]) -> str:
    """Render blocks as one self-contained HTML page; ``images`` maps a plot name to its PNG bytes."""
    body: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{_inline_html(block[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline_html(block[1])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{_inline_html(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{_inline_html(h)}</th>" for h in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>" for row in block[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "image":
            data = base64.b64encode(images[block[2]]).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(block[3])}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline_html(block[3])}</figcaption></figure>"
            )
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Performance report</title>"
        f"<style>{_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def merge_run_traces(trace_dirs: Sequence[str | Path], output: str | Path) -> dict[str, Any]:
    """Merge every ``trace.json`` under ``trace_dirs`` (a ``--trace`` run's log folders) into
    ``<output stem>_trace.json`` beside the report; returns what :func:`build_report` links as ``trace``.

    Raises:
        ReportInputError: a folder without traces, or a file that is not trace-event JSON.
    """
    from src.tracing import describe_trace, find_traces, merge_traces, read_trace, write_trace

    paths = []
    for folder in trace_dirs:
        found = find_traces(folder)
        if not found:
            raise ReportInputError(folder, "no trace.json under it (train with --trace and give its log folder)")
        paths += found
    traces = []
    for path in paths:
        try:
            traces.append(read_trace(path))
        except (ValueError, UnicodeDecodeError):
            raise ReportInputError(path, "not a trace-event JSON file") from None
    events = merge_traces(traces)
    output = Path(output)
    merged = write_trace(output.parent / f"{output.stem}_trace.json", events)
    return {"file": merged.name, "sources": [str(path) for path in paths], **describe_trace(events)}


def write_report(report: Mapping[str, Any], output: str | Path) -> dict[str, Path]:
    """Write the JSON report to ``output`` and, beside it, ``<stem>.md``, ``<stem>.html`` and the PNG
    plots in ``<stem>_plots/``; returns every path written by name."""
    from src.report_plots import draw_all  # matplotlib only when rendering

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    plot_dir = output.parent / f"{output.stem}_plots"
    plots = draw_all(report, plot_dir)
    blocks = report_blocks(report, plot_dir.name)
    paths = {"json": output, "markdown": output.with_suffix(".md"), "html": output.with_suffix(".html")}
    output.write_text(json.dumps(report, indent=2) + "\n")
    paths["markdown"].write_text(to_markdown(blocks))
    paths["html"].write_text(to_html(blocks, {name: path.read_bytes() for name, path in plots.items()}))
    return {**paths, **{f"plot:{name}": path for name, path in plots.items()}}
