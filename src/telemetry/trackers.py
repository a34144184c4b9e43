"""Experiment trackers (Weights & Biases, MLflow) as sinks of the run's events: one tracker run per training run.

``metrics.trackers: [tensorboard, wandb, mlflow]`` in the config, or ``--tracker NAME`` (repeatable,
added to the list). TensorBoard writes event files in every process's log folder
(:class:`src.metrics.TensorBoardSink`); a tracker here gets **one run per training run**, logged by
the process that owns the run summary only (the baseline trainer, DDP rank 0, the parameter server),
never one per worker or rank. What the tracker run holds:

* **parameters**: the resolved config, flattened to dotted names (``training.batch_size``; W&B keeps
  it nested); secrets never (``system.auth_token`` is excluded from every dump);
* **metrics**: every scalar event of that process as ``<kind>/<name>`` at its step
  (``train/loss``, ``eval/test_accuracy``), per-worker figures prefixed ``worker_<k>/`` (the
  parameter server's ``push`` events: Staleness, loss, gradient/compression/communication time, at
  the server version), and at the end the summary's numbers as final metrics (``final_accuracy``,
  ``total_time_s``, ``worker_<k>/bytes_sent``...);
* **artifacts**: the files the run hands to :meth:`src.metrics.MetricsLogger.finish` (its
  ``summary.json`` and final checkpoint).

A training run that a launcher restarts (a DDP group after a rank died, a recovered parameter
server) continues the same tracker run: the run ids are kept in ``<log_dir>/tracker_runs.json`` and
:func:`open_trackers` with ``resume=True`` reopens them.

Tracker I/O (a database write, a network call) runs on a thread of each sink's own, so a slow
tracker never stalls a training step or an RPC; a tracker that fails logs one warning and the run
goes on. A tracker whose package is missing is one error line naming the extra to install
(:func:`require_trackers`, called before any process starts).

Offline use: MLflow with a local store (``metrics.mlflow_tracking_uri: sqlite:///mlflow.db``, read
back with ``mlflow.tracking.MlflowClient``); W&B with ``metrics.wandb_mode: offline`` (or
``WANDB_MODE=offline``): the run lands in ``<log_dir>/wandb/offline-run-*/`` for ``wandb sync``.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from src.config import Config, SetupError
from src.metrics import MetricsSink

logger = logging.getLogger(__name__)

TRACKER_RUNS_FILE = "tracker_runs.json"
"""In the run's log folder: ``{tracker name: run id}``, so a restarted process continues its run."""
EVENT_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "push": (
        "version",
        ("staleness", "weight", "loss", "gradient_time_s", "compression_time_s", "communication_time_s", "num_samples"),
    ),
}
"""Non-scalar events whose numbers are metrics too: kind -> (the field that is their step, the fields)."""

Metric = tuple[str, float, int | None, float]  # name, value, step, unix time


class Tracker(ABC):
    """One run in one experiment tracker: the part of a sink that speaks the tracker's API."""

    name: ClassVar[str]
    package: ClassVar[str]
    """The module to import (and the pip package and extra of the same name)."""
    run_id: str

    @classmethod
    @abstractmethod
    def open(cls, config: Config, *, log_dir: Path, run_name: str, run_id: str | None) -> "Tracker":
        """Start a run (``run_id=None``) or continue run ``run_id``."""
        raise NotImplementedError

    @abstractmethod
    def log_params(self, params: Mapping[str, str], nested: Mapping[str, Any]) -> None:
        """The config, flattened (``params``) and as the nested dict (``nested``)."""
        raise NotImplementedError

    @abstractmethod
    def log_metrics(self, metrics: Sequence[Metric]) -> None:
        raise NotImplementedError

    @abstractmethod
    def log_summary(self, numbers: Mapping[str, float], text: Mapping[str, str]) -> None:
        """The run summary: numbers as final metrics, strings (architecture, dataset...) as tags."""
        raise NotImplementedError

    @abstractmethod
    def log_artifacts(self, paths: Sequence[Path]) -> None:
        raise NotImplementedError

    @abstractmethod
    def end(self, *, finished: bool) -> None:
        """Close the run: finished, or failed (the process stopped before the run's end)."""
        raise NotImplementedError


class MLflowTracker(Tracker):
    """An MLflow run through ``MlflowClient`` (no global active run: safe beside a user's own MLflow use)."""

    name = "mlflow"
    package = "mlflow"

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id

    @classmethod
    def open(cls, config: Config, *, log_dir: Path, run_name: str, run_id: str | None) -> "MLflowTracker":
        from mlflow.tracking import MlflowClient

        for noisy in ("alembic", "mlflow.store.db.utils"):  # table creation of a new SQLite store: INFO noise
            logging.getLogger(noisy).setLevel(logging.WARNING)
        client = MlflowClient(tracking_uri=config.metrics.mlflow_tracking_uri)
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            return cls(client, run_id)
        experiment = client.get_experiment_by_name(config.metrics.project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(config.metrics.project)
        run = client.create_run(
            experiment_id, run_name=run_name, tags={"architecture": config.system.architecture, "log_dir": str(log_dir)}
        )
        return cls(client, run.info.run_id)

    def log_params(self, params: Mapping[str, str], nested: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log_metrics(self, metrics: Sequence[Metric]) -> None:
        from mlflow.entities import Metric as MLflowMetric

        items = [MLflowMetric(key, value, int(at * 1000), step or 0) for key, value, step, at in metrics]
        for start in range(0, len(items), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=items[start : start + 1000])

    def log_summary(self, numbers: Mapping[str, float], text: Mapping[str, str]) -> None:
        now = time.time()
        self.log_metrics([(key, value, None, now) for key, value in numbers.items()])
        for key, value in text.items():
            self.client.set_tag(self.run_id, key, value)

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def end(self, *, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "FAILED")


class WandbTracker(Tracker):
    """A Weights & Biases run; its files go under ``<log_dir>/wandb/`` (offline: ``offline-run-*``)."""

    name = "wandb"
    package = "wandb"
    STEP = "step"
    """Every metric is plotted against this one (the events' own step), not wandb's call counter."""

    def __init__(self, run):
        self.run, self.run_id = run, run.id

    @classmethod
    def open(cls, config: Config, *, log_dir: Path, run_name: str, run_id: str | None) -> "WandbTracker":
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        # No console capture (the runner's stdout is its result), no system sampling, no git or code upload.
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False)
        run = wandb.init(
            project=config.metrics.project,
            name=run_name,
            dir=str(log_dir),
            mode=config.metrics.wandb_mode,
            id=run_id,
            resume="allow" if run_id else None,
            settings=settings,
            tags=[config.system.architecture],
        )
        run.define_metric(cls.STEP)
        run.define_metric("*", step_metric=cls.STEP)
        return cls(run)

    def log_params(self, params: Mapping[str, str], nested: Mapping[str, Any]) -> None:
        self.run.config.update(dict(nested), allow_val_change=True)

    def log_metrics(self, metrics: Sequence[Metric]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for key, value, step, _ in metrics:
            by_step.setdefault(step or 0, {})[key] = value
        for step, values in by_step.items():
            self.run.log({**values, self.STEP: step})

    def log_summary(self, numbers: Mapping[str, float], text: Mapping[str, str]) -> None:
        self.run.summary.update({**numbers, **text})

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        import wandb

        artifact = wandb.Artifact(f"run-{self.run_id}-files", type="run_files")
        for path in paths:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def end(self, *, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


TRACKERS: dict[str, type[Tracker]] = {tracker.name: tracker for tracker in (MLflowTracker, WandbTracker)}
"""The experiment trackers by name: every name of ``metrics.trackers`` except ``tensorboard``."""


# ----------------------------------------------------------------------------- events -> tracker calls


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b": leaf}`` (an empty dict stays a leaf)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_params(config: Config) -> dict[str, str]:
    """The resolved config as tracker parameters: dotted names, values as text (lists as JSON)."""
    return {
        key: value if isinstance(value, str) else json.dumps(value) for key, value in flatten(config.to_dict()).items()
    }


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _prefix(event: Mapping[str, Any]) -> str:
    if event.get("worker") is not None:
        return f"worker_{event['worker']}/"
    if event.get("rank") is not None:
        return f"rank_{event['rank']}/"
    return ""


def summary_metrics(summary: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """A run summary as (final metrics, text tags): numbers dotted by nesting, per-worker entries
    (the parameter server's ``workers``) prefixed ``worker_<k>/`` (``worker_<k>/incarnation_<i>/``
    for a worker that ran as several incarnations)."""
    numbers: dict[str, float] = {}
    text: dict[str, str] = {}
    workers = [entry for entry in summary.get("workers") or [] if isinstance(entry, Mapping)]
    incarnations: dict[Any, int] = {}
    for entry in workers:
        incarnations[entry.get("worker_id")] = incarnations.get(entry.get("worker_id"), 0) + 1
    for key, value in flatten({k: v for k, v in summary.items() if k != "workers"}).items():
        number = _number(value)
        if number is not None:
            numbers[key] = number
        elif isinstance(value, str):
            text[key] = value
    for entry in workers:
        prefix = f"worker_{entry.get('worker_id')}/"
        if incarnations[entry.get("worker_id")] > 1:
            prefix += f"incarnation_{entry.get('incarnation')}/"
        for key, value in flatten(entry).items():
            number = _number(value)
            if number is not None and key not in ("worker_id", "incarnation"):
                numbers[prefix + key] = number
    return numbers, text


class TrackerSink(MetricsSink):
    """Feeds one :class:`Tracker` from :class:`src.metrics.MetricsLogger`'s events, on a thread of its own.

    Args:
        tracker: the open tracker run.
        params: what :meth:`Tracker.log_params` gets first (``None``: a continued run has them).
        nested: the config as a nested dict (W&B's config).
    """

    def __init__(self, tracker: Tracker, params: Mapping[str, str] | None, nested: Mapping[str, Any]):
        self.tracker = tracker
        self._queue: queue.Queue = queue.Queue()
        self._finished = False
        self._failed = False
        self._thread = threading.Thread(target=self._work, name=f"tracker-{tracker.name}", daemon=True)
        if params is not None:
            self._queue.put(("params", (params, nested)))
        self._thread.start()

    # --- MetricsSink (any thread): only enqueue
    def scalars(self, kind: str, step: int, values: Mapping[str, float], event: Mapping[str, Any]) -> None:
        prefix, at = _prefix(event), event.get("time", time.time())
        metrics = [
            (f"{prefix}{kind}/{name}", number, step, at)
            for name, value in values.items()
            if (number := _number(value)) is not None
        ]
        if metrics:
            self._queue.put(("metrics", metrics))

    def event(self, event: Mapping[str, Any]) -> None:
        wanted = EVENT_METRICS.get(event.get("kind"))
        if wanted is None:
            return
        step_field, fields = wanted
        step, prefix, at = event.get(step_field), _prefix(event), event.get("time", time.time())
        metrics = [
            (f"{prefix}{event['kind']}/{name}", number, step, at)
            for name in fields
            if (number := _number(event.get(name))) is not None
        ]
        if metrics:
            self._queue.put(("metrics", metrics))

    def finish(self, summary: Mapping[str, Any], artifacts: Sequence[Path]) -> None:
        self._queue.put(("finish", (summary_metrics(summary), list(artifacts))))
        self._finished = True

    def close(self) -> None:
        self._queue.put(("stop", None))
        self._thread.join()
        try:
            self.tracker.end(finished=self._finished)
        except Exception as exc:  # noqa: BLE001 - a tracker's failure must not fail the training run
            self._warn(exc)

    # --- the sink's thread
    def _work(self) -> None:
        while True:
            kind, payload = self._queue.get()
            if kind == "stop":
                return
            batch: list[Metric] = []
            while kind == "metrics":  # everything queued meanwhile goes in one call
                batch += payload
                try:
                    kind, payload = self._queue.get_nowait()
                except queue.Empty:
                    kind, payload = "done", None
            if batch:
                self._call(self.tracker.log_metrics, batch)
            if kind == "params":
                self._call(self.tracker.log_params, *payload)
            elif kind == "finish":
                (numbers, text), artifacts = payload
                self._call(self.tracker.log_summary, numbers, text)
                self._call(self.tracker.log_artifacts, artifacts)
            elif kind == "stop":
                return

    def _call(self, method, *args) -> None:
        try:
            method(*args)
        except Exception as exc:  # noqa: BLE001 - see close()
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self._failed:
            self._failed = True
            logger.warning(
                "%s tracker: %s: %s (the run goes on; later failures of this tracker are not shown)",
                self.tracker.name,
                type(exc).__name__,
                " ".join(str(exc).split())[:300],
            )


# ----------------------------------------------------------------------------- opening


def tracker_names(config: Config) -> list[str]:
    """The experiment trackers ``metrics.trackers`` asks for (TensorBoard is not one: see the module docstring)."""
    return [name for name in config.metrics.trackers if name in TRACKERS]


def require_trackers(config: Config) -> None:
    """Check that every tracker's package imports, before a run starts anything.

    Raises:
        SetupError: one line naming the tracker and the extra to install.
    """
    import importlib

    for name in tracker_names(config):
        package = TRACKERS[name].package
        try:
            importlib.import_module(package)
        except ImportError:
            raise SetupError(
                f"metrics.trackers: {name} needs the {package} package: pip install -e '.[{name}]' "
                f"(or pip install {package})"
            ) from None


def open_trackers(config: Config, log_dir: str | Path, *, resume: bool = False) -> list[TrackerSink]:
    """One sink per tracker of ``metrics.trackers`` (none for TensorBoard), each with its run opened.

    Call it in the process that owns the run summary, once per training run, and pass the sinks to
    its :class:`src.metrics.MetricsLogger` (which closes them).

    Args:
        log_dir: the run's log folder (``tracker_runs.json`` and W&B's files go there).
        resume: continue the tracker runs recorded in ``log_dir`` (a restarted process of the same
            training run); without a record, new runs start.

    Raises:
        SetupError: a tracker's package is missing.
    """
    names = tracker_names(config)
    if not names:
        return []
    require_trackers(config)
    log_dir = Path(log_dir)
    record_path = log_dir / TRACKER_RUNS_FILE
    known = json.loads(record_path.read_text()) if resume and record_path.is_file() else {}
    run_name = config.metrics.run_name or f"{config.system.architecture}-{time.strftime('%Y%m%d-%H%M%S')}"
    sinks, runs = [], {}
    nested = config.to_dict()
    params = config_params(config)
    for name in names:
        run_id = known.get(name)
        tracker = TRACKERS[name].open(config, log_dir=log_dir, run_name=run_name, run_id=run_id)
        runs[name] = tracker.run_id
        sinks.append(TrackerSink(tracker, params if run_id is None else None, nested))
        logger.info("%s tracker: run %s (%s)", name, tracker.run_id, "continued" if run_id else "started")
    log_dir.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(runs, indent=2) + "\n")
    return sinks
