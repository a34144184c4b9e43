"""Telemetry: ``events.jsonl`` (the source of truth), sinks fed from the same events (TensorBoard,
the experiment trackers of :mod:`src.telemetry.trackers`), and the run summary JSON every runner writes.

An event is one JSON object per line with ``time`` (unix seconds), ``kind`` and its fields.
:class:`MetricsLogger` writes each event, then hands it to its sinks (:class:`MetricsSink`): scalar
events (:meth:`MetricsLogger.scalars`) go to TensorBoard as ``<kind>/<name>`` at their ``step``, so
TensorBoard, the trackers, the report and any controller read the same numbers. At the end of a run
the process that owns the run summary calls :meth:`MetricsLogger.finish` with the summary and the
files worth keeping (summary, checkpoint), which the trackers store as final metrics and artifacts.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

LOG_EVERY_STEPS = 10
"""Training loops mirror a step's scalars to TensorBoard every this many steps (and at epoch ends)."""
SUMMARY_FIELDS = (
    "architecture",
    "dataset",
    "num_workers",
    "final_accuracy",
    "final_loss",
    "total_time_s",
    "throughput_samples_per_s",
    "samples_processed",
    "bytes_sent",
    "bytes_received",
    "compression",
    "checkpoint_path",
)


_PLAIN_TYPES = frozenset({str, int, bool, type(None), list, dict, tuple})
"""Values an event holds as they are (:func:`_jsonable` changes none of them)."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):  # 0-d tensors and numpy scalars
        return value.item()
    return value


class EventLog:
    """Append-only ``events.jsonl``; each event is one whole line, written and flushed under a lock.

    The parameter server writes events from several gRPC threads at once: without the lock a long
    line can be split by another thread's write. A killed process loses nothing already written.

    :meth:`write_later` records an event (its ``time`` and fields, now) that is written, in order,
    by the next :meth:`write` or :meth:`flush`: the server records a push's events under its lock and
    writes them once the push's reply is on its way (JSON and the file write off the critical path).
    """

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self._clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a")
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []

    def _event(self, kind: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        event = {"time": self._clock(), "kind": kind}
        for key, value in fields.items():  # the server writes a few events per push: plain values pass as they are
            event[key] = value if type(value) in _PLAIN_TYPES else _jsonable(value)
        return event

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = self._event(kind, fields)
        line = json.dumps(event) + "\n"
        with self._lock:
            if self._pending:
                self._write_pending()
            self._handle.write(line)
            self._handle.flush()
        return event

    def write_later(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record an event now, write it with the next :meth:`write` or :meth:`flush` (the order is kept)."""
        event = self._event(kind, fields)
        with self._lock:
            self._pending.append(event)
        return event

    def flush(self) -> None:
        """Write the events recorded by :meth:`write_later`."""
        if self._pending:
            with self._lock:
                self._write_pending()

    def _write_pending(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._handle.closed:
            self._handle.write("".join(json.dumps(event) + "\n" for event in pending))
            self._handle.flush()

    def close(self) -> None:
        with self._lock:
            if not self._handle.closed:
                self._write_pending()
                self._handle.close()


def read_events(path: str | Path, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """Events from ``events.jsonl``, optionally only one ``kind``; a torn last line is skipped."""
    with open(path) as handle:
        for line in handle:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or event.get("kind") == kind:
                yield event


class MetricsSink:
    """Where :class:`MetricsLogger` forwards what it writes; every method does nothing by default.

    Called from whichever thread logged the event (the parameter server logs from its RPC threads):
    a sink that does slow I/O hands the work to a thread of its own (see :mod:`src.telemetry.trackers`).
    """

    def event(self, event: Mapping[str, Any]) -> None:
        """A non-scalar event as written to ``events.jsonl`` (with ``time`` and ``kind``)."""

    def scalars(self, kind: str, step: int, values: Mapping[str, float], event: Mapping[str, Any]) -> None:
        """A scalar event: ``values`` at ``step``; ``event`` is the whole line written (its other fields)."""

    def finish(self, summary: Mapping[str, Any], artifacts: Sequence[Path]) -> None:
        """The run is over: its summary and the files to keep."""

    def close(self) -> None:
        """Flush and release; called once, last."""


class TensorBoardSink(MetricsSink):
    """Scalars as TensorBoard scalars ``<kind>/<name>`` in ``log_dir`` (torch's SummaryWriter)."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, kind: str, step: int, values: Mapping[str, float], event: Mapping[str, Any]) -> None:
        for name, value in values.items():
            if value is not None:
                self._writer.add_scalar(f"{kind}/{name}", float(value), step)

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Events to ``<log_dir>/events.jsonl``, forwarded to TensorBoard under ``log_dir`` and to ``sinks``.

    Args:
        log_dir: folder for ``events.jsonl`` and the TensorBoard event files.
        tensorboard: set False to write no TensorBoard files (benchmarks; ``metrics.trackers``
            without ``tensorboard``).
        sinks: more receivers of the same events (:func:`src.telemetry.trackers.open_trackers`); closed with
            this logger.
        clock: the events' ``time`` (default ``time.time``; a virtual-time run passes its clock's).
        fields: added to every event (e.g. ``worker=1``).
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        tensorboard: bool = True,
        sinks: Sequence[MetricsSink] = (),
        clock: Callable[[], float] = time.time,
        **fields: Any,
    ):
        self.log_dir = Path(log_dir)
        self.events = EventLog(self.log_dir / "events.jsonl", clock=clock)
        self._fields = fields
        self.sinks: list[MetricsSink] = [TensorBoardSink(self.log_dir)] if tensorboard else []
        self.sinks += sinks

    def event(self, kind: str, *, later: bool = False, **fields: Any) -> dict[str, Any]:
        """Record a non-scalar event (run start, checkpoint written, push rejected...).

        ``later``: written to ``events.jsonl`` at the next write or :meth:`flush` (:meth:`EventLog.write_later`);
        the sinks get it now.
        """
        write = self.events.write_later if later else self.events.write
        event = write(kind, **self._fields, **fields)
        for sink in self.sinks:
            sink.event(event)
        return event

    def flush(self) -> None:
        """Write the events recorded with ``later=True``."""
        self.events.flush()

    def scalars(self, kind: str, step: int, values: Mapping[str, float], **fields: Any) -> dict[str, Any]:
        """Record ``values`` at ``step`` as one event, forwarded to the sinks (TensorBoard: ``<kind>/<name>``)."""
        event = self.events.write(kind, **self._fields, step=step, **fields, **values)
        for sink in self.sinks:
            sink.scalars(kind, step, values, event)
        return event

    def finish(self, summary: Mapping[str, Any], artifacts: Sequence[str | Path] = ()) -> None:
        """Hand the run's summary and its files worth keeping (summary JSON, checkpoint) to the sinks.

        Only the process that owns the run summary calls it, once, before :meth:`close`.
        """
        existing = [Path(path) for path in artifacts if path is not None and Path(path).is_file()]
        for sink in self.sinks:
            sink.finish(summary, existing)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
        self.events.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TimeToTarget:
    """Time to target accuracy: the first evaluation at or above ``target``, in wall seconds and steps.

    Every architecture feeds it each evaluation (``observe``) with the seconds since its training
    clock started and its step counter (baseline and DDP: optimizer steps; parameter server: server
    versions), and puts :meth:`fields` into its run summary, so the figure means the same everywhere.

    Args:
        target: accuracy in (0, 1], or ``None`` (no target: the fields are ``None``).
    """

    def __init__(self, target: float | None):
        self.target = target
        self.seconds: float | None = None
        self.step: int | None = None

    def observe(self, accuracy: float, seconds: float, step: int) -> bool:
        """Record one evaluation; returns True the first time the target is reached."""
        if self.target is None or self.seconds is not None or not accuracy >= self.target:
            return False
        self.seconds, self.step = float(seconds), int(step)
        return True

    def fields(self) -> dict[str, Any]:
        """``target_accuracy``, ``time_to_target_s``, ``time_to_target_step`` for a run summary."""
        return {"target_accuracy": self.target, "time_to_target_s": self.seconds, "time_to_target_step": self.step}


def write_summary(path: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write the run summary JSON; every field of :data:`SUMMARY_FIELDS` must be present."""
    missing = [name for name in SUMMARY_FIELDS if name not in summary]
    if missing:
        raise ValueError(f"run summary lacks fields: {', '.join(missing)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2) + "\n")
    return path


def format_summary(summary: Mapping[str, Any]) -> str:
    """The final lines every runner prints."""
    lines = [
        f"Final Accuracy: {summary['final_accuracy'] * 100:.2f}%",
        f"Final Loss: {summary['final_loss']:.4f}",
        f"Total Time: {summary['total_time_s']:.2f}s",
        f"Throughput: {summary['throughput_samples_per_s']:.1f} samples/s",
    ]
    if summary.get("bytes_sent"):
        lines.append(f"Bytes Sent: {summary['bytes_sent']:,}  Bytes Received: {summary['bytes_received']:,}")
    if summary.get("checkpoint_path"):
        lines.append(f"Checkpoint: {summary['checkpoint_path']}")
    return "\n".join(lines)
