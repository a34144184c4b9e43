"""Timelines: spans written as Chrome trace-event JSON, one ``trace.json`` per process, mergeable.

``--trace`` (``system.trace``) makes each process of a run write ``trace.json`` in its own log
folder; open it in https://ui.perfetto.dev or ``chrome://tracing``. ``generate_performance_report.py
--trace-dir DIR`` merges every ``trace.json`` under ``DIR`` (a run's log folder) into one file, and
the report links it.

Instrumenting code (the API the trainers, the parameter server, its workers and the DDP hooks use)::

    from src.telemetry import tracing

    with tracing.trace_to(log_dir / "trace.json", "worker 1", enabled=config.system.trace):
        ...                                        # the process's work
        with tracing.span("step", step=n):         # any code, any thread, nested freely
            with tracing.span("forward_backward"):
                ...
            with tracing.span("push", bytes=len(payload)):
                ...

* :func:`trace_to` starts this process's tracer (one per process; ``enabled=False`` does nothing)
  and writes the file when it exits. A process started with spawn calls it itself.
* :func:`span` is a context manager: one complete event (``"ph": "X"``) with ``ts`` and ``dur`` in
  microseconds, ``pid``, ``tid`` (the OS thread id), the ``name`` and keyword ``args`` (JSON-able
  values: numbers, strings). Spans of one thread nest by time, as the ``with`` blocks do.
* Every span is also a ``torch.profiler.record_function(name)`` label while a torch profiler is
  recording, so a user's own ``torch.profiler.profile()`` run shows the same names. With neither
  tracing nor a profiler on, a span costs one global read and one C call: about 0.3 us here, against
  about 7.5 us for a recorded span (docs/observability.md): leave spans in.
* :func:`record` adds a span from two ``time.perf_counter()`` readings the code already takes, for
  an interval that no single ``with`` block delimits (a loop iteration with ``continue`` in it, the
  wait at the end of DDP's backward pass, which a hook on another thread opens). It is not a
  profiler label.
* Names in use (keep to them so merged traces read alike), see docs/observability.md for where:
  ``epoch``, ``step``, ``forward_backward``, ``optimizer_step``, ``evaluate``, ``checkpoint``
  (every trainer); ``compress``, ``push``, ``pull``, ``settle`` (a parameter-server worker; streaming: ``reply_wait``,
  ``parameter_wait``, and ``compress`` per part and ``push`` on the push's thread; its TCP client, each call:
  ``send``, ``await_reply``, ``receive``); ``serve_push``, ``serve_pull``, ``decode``, ``apply`` (sync: > ``average``,
  ``optimizer_step``), ``barrier_wait``, ``reply``, ``downlink_wait`` (the server; its TCP transport: ``receive`` a
  push, ``send`` a reply);
  ``hook_exchange``, ``exchange_wait`` (DDP).

Clock: ``ts`` is wall-clock time in microseconds since the Unix epoch, taken as ``perf_counter``
plus one offset read at the tracer's start, so durations are monotonic and the traces of different
processes (and machines with synchronized clocks) line up when merged. A simulation passes its own
clock instead (:class:`Tracer`'s ``clock``: the virtual-time run, :mod:`src.virtual.run`, writes
its simulated processes' spans in virtual seconds, with explicit times, through :meth:`Tracer.complete`).

File format: the JSON array form of the trace-event format, written as spans end (buffered) and
closed with ``]`` by :func:`trace_to`: the file is valid JSON once the process ends cleanly; a
killed process leaves the array unclosed, which Perfetto, ``chrome://tracing`` and
:func:`read_trace` still read.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

TRACE_FILE = "trace.json"


class Tracer:
    """Writes one process's spans to ``path`` as trace events; thread-safe.

    Args:
        path: the ``trace.json`` to write (its folder is made).
        process_name: what the timeline calls this process (``baseline``, ``worker 1``, ``rank 0``).
        pid: the process id in the events (default: this process's; a simulated process has its own).
        clock: seconds of another clock (a simulation's) that :meth:`now_us` reads instead of the wall clock.
    """

    def __init__(
        self, path: str | Path, process_name: str, *, pid: int | None = None, clock: Callable[[], float] | None = None
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid() if pid is None else pid
        self._clock = clock
        # wall-clock microseconds = perf_counter microseconds + this offset (one reading of each clock)
        self._offset_us = time.time_ns() / 1000.0 - time.perf_counter_ns() / 1000.0
        self._lock = threading.Lock()
        self._handle = open(self.path, "w")
        self._handle.write("[")
        self._first = True
        self._threads: set[int] = set()
        self.spans = 0
        self._write({"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0, "args": {"name": process_name}})

    def now_us(self) -> float:
        """This tracer's clock: wall-clock microseconds since the Unix epoch, monotonic within the process
        (or the given clock's microseconds)."""
        if self._clock is not None:
            return self._clock() * 1e6
        return time.perf_counter_ns() / 1000.0 + self._offset_us

    def perf_counter_us(self, seconds: float) -> float:
        """A ``time.perf_counter()`` reading on this tracer's (wall) clock, in microseconds."""
        return seconds * 1e6 + self._offset_us

    def _write(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, default=str)
        with self._lock:
            if self._handle.closed:
                return  # a span that ends after the tracer stopped (another thread) is dropped
            self._handle.write(("\n" if self._first else ",\n") + line)
            self._first = False

    def complete(
        self,
        name: str,
        start_us: float,
        end_us: float,
        args: dict[str, Any] | None = None,
        *,
        tid: int | None = None,
        thread_name: str | None = None,
    ) -> None:
        """Record one finished span (a complete event) of the calling thread, or of thread ``tid``
        (a simulated one, named ``thread_name`` the first time)."""
        if tid is None:
            tid, thread_name = threading.get_native_id(), threading.current_thread().name
        if tid not in self._threads:
            self._threads.add(tid)
            self._write(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": self.pid,
                    "tid": tid,
                    "args": {"name": thread_name or str(tid)},
                }
            )
        event = {
            "ph": "X",
            "name": name,
            "ts": round(start_us, 3),
            "dur": round(end_us - start_us, 3),
            "pid": self.pid,
            "tid": tid,
        }
        if args:
            event["args"] = args
        self._write(event)
        self.spans += 1

    @contextlib.contextmanager
    def span(self, name: str, args: dict[str, Any] | None = None) -> Iterator[None]:
        start = self.now_us()
        with _profiler_label(name):
            try:
                yield
            finally:
                self.complete(name, start, self.now_us(), args)

    def close(self) -> None:
        """Close the JSON array and the file; later spans are dropped."""
        with self._lock:
            if not self._handle.closed:
                self._handle.write("\n]\n")
                self._handle.close()


_active: Tracer | None = None
_NO_SPAN = contextlib.nullcontext()


def _torch_profiling() -> bool:
    torch = sys.modules.get("torch")  # never imports torch: the report tools read traces without it
    return torch is not None and torch.autograd._profiler_enabled()


def _profiler_label(name: str):
    if _torch_profiling():
        import torch

        return torch.profiler.record_function(name)
    return _NO_SPAN


def span(name: str, **args: Any):
    """A context manager timing its block as span ``name`` (``args`` go into the event).

    A no-op unless :func:`trace_to` is active in this process or a torch profiler is recording.
    """
    tracer = _active
    if tracer is None:
        return _profiler_label(name) if _torch_profiling() else _NO_SPAN
    return tracer.span(name, args)


def record(name: str, start_s: float, end_s: float, **args: Any) -> None:
    """Record span ``name`` from two ``time.perf_counter()`` readings of the calling thread (a no-op
    unless tracing); it nests like a ``with`` block that ran from ``start_s`` to ``end_s``."""
    tracer = _active
    if tracer is not None:
        tracer.complete(name, tracer.perf_counter_us(start_s), tracer.perf_counter_us(end_s), args)


def active() -> Tracer | None:
    """This process's tracer, or ``None`` when not tracing."""
    return _active


@contextlib.contextmanager
def trace_to(
    path: str | Path, process_name: str, *, enabled: bool = True, restart: bool = False
) -> Iterator[Tracer | None]:
    """Trace this process into ``path`` while the block runs (``enabled=False``: do nothing).

    ``restart``: this process continues an earlier one of the same run (a restarted worker, server
    or DDP attempt), whose ``path`` is kept: this one writes ``trace.1.json``, ``trace.2.json``, ...
    beside it (the first name free), which :func:`find_traces` finds too.

    Raises:
        RuntimeError: a tracer is already active in this process.
    """
    global _active
    if not enabled:
        yield None
        return
    if _active is not None:
        raise RuntimeError(f"already tracing into {_active.path}")
    path, first, attempt = Path(path), Path(path), 0
    if restart:
        while path.exists():
            attempt += 1
            path = first.with_name(f"{first.stem}.{attempt}{first.suffix}")
    tracer = Tracer(path, f"{process_name} (restart {attempt})" if attempt else process_name)
    _active = tracer
    try:
        yield tracer
    finally:
        _active = None
        tracer.close()


# ----------------------------------------------------------------------------- reading and merging


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file: the JSON array form (closed or, from a killed process, not) or
    the object form ``{"traceEvents": [...]}``.

    Raises:
        ValueError: not trace-event JSON (the message names the file).
    """
    text = Path(path).read_text().strip()
    for candidate in (text, text.rstrip(",") + "\n]"):
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        events = data.get("traceEvents") if isinstance(data, dict) else data
        if isinstance(events, list) and all(isinstance(e, dict) for e in events):
            return events
    raise ValueError(f"{path}: not a trace-event JSON file (an array of events or {{\"traceEvents\": [...]}})")


def find_traces(root: str | Path) -> list[Path]:
    """Every ``trace.json`` under ``root`` (and a restarted process's ``trace.<n>.json``), in path order."""
    stem, suffix = TRACE_FILE.rsplit(".", 1)
    found = set(Path(root).rglob(TRACE_FILE)) | set(Path(root).rglob(f"{stem}.[0-9]*.{suffix}"))
    return sorted(found)


def merge_traces(traces: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The events of several traces (each as :func:`read_trace` returns it) on one timeline; they
    already share the wall clock, so no event's time changes.

    Two traces from processes that happened to get the same pid (two runs, or two machines) are
    kept apart: the later one's pid is renumbered.
    """
    merged: list[dict[str, Any]] = []
    used: set[int] = set()
    for events in traces:
        pids = {e.get("pid") for e in events if isinstance(e.get("pid"), int)}
        renumber = {}
        for pid in sorted(pids):
            new = pid
            while new in used:
                new += 1_000_000
            renumber[pid] = new
        used.update(renumber.values())
        merged += [{**e, "pid": renumber.get(e.get("pid"), e.get("pid"))} for e in events]
    return merged


def load_traces(source: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file, or of every trace under a folder merged (:func:`merge_traces`).

    Raises:
        ValueError: ``source`` is neither, a folder holds no trace, or a file is not a trace (the message names it).
    """
    source = Path(source)
    if source.is_dir():
        paths = find_traces(source)
        if not paths:
            raise ValueError(f"{source}: no trace.json under it (train with --trace)")
        return merge_traces(read_trace(path) for path in paths)
    if source.is_file():
        return read_trace(source)
    raise ValueError(f"{source}: no such file or folder")


def write_trace(path: str | Path, events: list[dict[str, Any]]) -> Path:
    """Write ``events`` as a trace file in the object form (``displayTimeUnit``: ms)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
    return path


def describe_trace(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """What a (merged) trace holds: its processes, span counts and seconds by name, and the time it covers."""
    names: dict[int, str] = {}
    per_pid: dict[int, int] = {}
    by_name: dict[str, dict[str, float]] = {}
    first, last = None, None
    for event in events:
        pid = event.get("pid")
        if event.get("ph") == "M" and event.get("name") == "process_name":
            names[pid] = str((event.get("args") or {}).get("name", pid))
        if event.get("ph") != "X":
            continue
        per_pid[pid] = per_pid.get(pid, 0) + 1
        entry = by_name.setdefault(event["name"], {"count": 0, "seconds": 0.0})
        entry["count"] += 1
        entry["seconds"] += event["dur"] / 1e6
        first = event["ts"] if first is None else min(first, event["ts"])
        last = event["ts"] + event["dur"] if last is None else max(last, event["ts"] + event["dur"])
    pids = sorted(set(names) | set(per_pid), key=lambda pid: (names.get(pid, ""), pid))
    return {
        "processes": [{"pid": pid, "name": names.get(pid, str(pid)), "spans": per_pid.get(pid, 0)} for pid in pids],
        "spans": sum(per_pid.values()),
        "seconds": (last - first) / 1e6 if first is not None else 0.0,
        "names": dict(sorted(by_name.items())),
    }
