"""Process supervision shared by the local launchers (parameter server and DDP).

* :class:`LaunchError`: a child of the run failed; the message names it and why.
* :func:`stop_processes`: terminate every child still running, wait a grace period, kill the rest,
  reap everything. Runs in every launcher's ``finally``, so Ctrl-C, an error or a normal end
  leaves no process behind.
* :func:`children_ignore_sigint`: start children inside it and they inherit an ignored SIGINT
  through exec, so a terminal's Ctrl-C reaches only the launcher, which decides what to stop.
* :func:`sigterm_as_keyboard_interrupt`: SIGTERM to the launcher takes the Ctrl-C path.
* :class:`RejoinGrace`: the parameter-server launchers' policy for a worker the server declared
  failed while its process still runs (wait for it to rejoin, else it is hung: kill it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Iterable, Iterator, NoReturn

STOP_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """A process of the run failed; the message names it and why."""


def leave_process(code: int) -> NoReturn:
    """End a child process with ``code`` once its outputs are flushed, skipping interpreter shutdown.

    Native threads that outlive a run (gloo's after DDP, gRPC's and torch's pools) are torn down
    while the interpreter shuts down, where they can abort a process that has succeeded (``terminate
    called without an active exception``, SIGABRT); a launcher would then count a failed process and
    restart it. Every output is closed by the time a run's process returns (summaries, events,
    TensorBoard, checkpoints fsynced), so leaving without that teardown loses nothing.
    """
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to save
            pass
    os._exit(code)


class RejoinGrace:
    """Which worker processes, declared failed by the server while they still ran, are hung.

    The server cannot tell a hung process (SIGSTOPped, deadlocked) from one that was only silent for a
    while (a long pause, a partition): both stopped heartbeating. The second kind rejoins by itself
    as a new incarnation (:mod:`src.worker`, ``system.max_rejoins``) as soon as it runs again. So the
    launcher gives such a process ``grace_s`` to rejoin: one that did is left alone; one still running
    without having rejoined is hung, and the launcher kills it (it is then restarted like any worker
    that died, under ``system.max_restarts``). One revocation thus ends in a rejoin or in a restart,
    never both. With ``grace_s`` 0 (workers that may not rejoin) a failed live process is hung at once.

    Pure bookkeeping on the caller's clock: :meth:`failed` and :meth:`rejoined` as the server's events
    arrive, :meth:`due` for the processes whose grace ran out.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.waiting: dict[int, tuple[int, float]] = {}
        """worker id -> (pid of the process declared failed, when its grace ends)."""

    def failed(self, worker: int, pid: int, now: float) -> None:
        """The server declared ``worker``'s incarnation failed while its process ``pid`` still runs."""
        self.waiting[worker] = (pid, now + self.grace_s)

    def rejoined(self, worker: int, pid: int) -> None:
        """Process ``pid`` registered ``worker`` again: it came back by itself."""
        if self.waiting.get(worker, (None,))[0] == pid:
            del self.waiting[worker]

    def due(self, now: float) -> list[tuple[int, int]]:
        """``(worker, pid)`` of every process whose grace has ended without a rejoin (forgotten here)."""
        ended = [(worker, pid) for worker, (pid, deadline) in self.waiting.items() if deadline <= now]
        for worker, _ in ended:
            del self.waiting[worker]
        return ended

    def next_deadline(self) -> float | None:
        """When the next grace ends (``None``: none running)."""
        return min((deadline for _, deadline in self.waiting.values()), default=None)


def rejoin_grace_s(system) -> float:
    """How long a launcher waits for a revoked worker to rejoin: a heartbeat timeout (it is told at its next
    call, within a step, and a heartbeat interval at most when it waits), or 0 when workers may not rejoin."""
    return system.heartbeat_timeout if system.max_rejoins > 0 else 0.0


def stop_processes(processes: Iterable, grace_s: float = STOP_GRACE_S) -> None:
    """Terminate every process still running, wait up to ``grace_s`` in all, kill the stragglers, reap all.

    Works on :class:`multiprocessing.Process` objects (``is_alive``/``terminate``/``join``/``kill``).
    """
    processes = list(processes)
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Children started inside this block ignore SIGINT (the launcher handles Ctrl-C for them)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_keyboard_interrupt() -> Iterator[None]:
    """Inside this block SIGTERM raises :class:`KeyboardInterrupt`, so it stops the run like Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what is printed (by this process and the children it starts) to stderr, e.g. while a
    benchmark's runs print progress and its stdout is kept for the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
