"""Process supervision shared by the local launchers (parameter server and DDP).

* :class:`LaunchError`: a child of the run failed; the message names it and why.
* :func:`stop_processes`: terminate every child still running, wait a grace period, kill the rest,
  reap everything. Runs in every launcher's ``finally``, so Ctrl-C, an error or a normal end
  leaves no process behind.
* :func:`children_ignore_sigint`: start children inside it and they inherit an ignored SIGINT
  through exec, so a terminal's Ctrl-C reaches only the launcher, which decides what to stop.
* :func:`sigterm_as_keyboard_interrupt`: SIGTERM to the launcher takes the Ctrl-C path.
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
