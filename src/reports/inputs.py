"""The performance report's input files: reading and checking the runs, and writing a runner's artifacts.

Inputs are what the runners already write: run summaries (``summary.json``, or the files
``--artifacts-dir`` writes: ``baseline.json``, ``ps.json``, ``ddp_rank_<r>.json``,
``worker_metrics.json``) and ``events.jsonl`` logs (eval curves, staleness, faults).

* reading (:func:`runs_from_files`, :func:`runs_from_dir`): every file is checked on the way in; a
  missing, malformed or foreign file raises :class:`ReportInputError`, whose text is one line naming
  the file and the problem. What comes out is :class:`Run` objects, which :func:`src.reports.report.build_report`
  turns into the report.
* :func:`write_artifacts`: what a runner's ``--artifacts-dir`` writes, from the summary it got back
  and its log folder.

Event logs are shared by runs that reuse a log folder (``EventLog`` appends), so a run's events are
cut from its log (:func:`select_run_events`): from just after the previous ``run_end`` of the run's
main log to its last ``run_end``; events of the run's other logs (workers, ranks) in that window.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from src.metrics import SUMMARY_FIELDS, write_summary

ARCHITECTURES = ("baseline", "parameter_server", "ddp")
ARTIFACT_NAMES = {"baseline": "baseline", "parameter_server": "ps", "ddp": "ddp"}
"""``--artifacts-dir`` file stem of each architecture: ``<stem>.json``, ``<stem>_events.jsonl``."""
WORKER_METRICS_NAME = "worker_metrics.json"
EVENTS_SUFFIX = "_events.jsonl"
_NUMERIC_FIELDS = tuple(
    name
    for name in SUMMARY_FIELDS
    if name not in ("architecture", "dataset", "num_workers", "compression", "checkpoint_path")
)
"""The summary's figures (final accuracy and loss, times, throughput, samples, bytes): numbers or ``None``."""


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
