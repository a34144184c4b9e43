"""The machine lock between the suite's two lanes (pytest-xdist workers): a readers-writer lock on files.

Every test holds the machine lock shared; a test marked ``alone`` holds it exclusive, so nothing else runs
beside it (tests/conftest.py takes it around each test). A test marked ``cluster`` holds it shared and a third
file, the cluster lock, exclusive: it runs beside an ordinary test but never beside another ``cluster`` test or an
``alone`` one. All are ``flock`` locks on one run's files, so a lane that dies lets go of them. A turnstile, taken
before the machine lock and let go once it is held, keeps a waiting exclusive holder from being overtaken for ever
by the other lane's shared ones: while it waits it holds the turnstile, and the next shared holder queues behind it.

A lane keeps its exclusive hold from one ``alone`` test to the next when they follow each other
(:class:`LaneLock`): let go between them, the hold would go to the other lane for one of its tests while this
lane, next to run alone, waits with a core idle.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple


def lock_folder(controller_pid: int) -> Path:
    """The folder of one xdist run's two lock files, named by the controller's pid (the workers' parent)."""
    return Path(tempfile.gettempdir()) / f"dts-pytest-lanes-{controller_pid}"


SHARED, CLUSTER, EXCLUSIVE = "shared", "cluster", "exclusive"
"""The holds a test takes: an ordinary test's, a ``cluster`` test's, an ``alone`` test's."""


@contextmanager
def holding(folder: Path, hold: str) -> Iterator[None]:
    """Hold the machine lock in ``folder`` for the ``with`` block (through the turnstile): shared, shared with the
    cluster lock exclusive (taken once the machine is held: a lane waiting for it holds no turnstile, and its
    holder never waits for the machine), or exclusive."""
    folder.mkdir(exist_ok=True)
    with open(folder / "turnstile", "a") as turnstile, open(folder / "machine", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if hold == EXCLUSIVE else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            if hold != CLUSTER:
                yield
                return
            with open(folder / "cluster", "a") as cluster:
                fcntl.flock(cluster, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(cluster, fcntl.LOCK_UN)
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


class LaneLock:
    """One lane's hold on the machine lock in ``folder``, which may outlast a test (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.hold: str | None = None  # SHARED, CLUSTER or EXCLUSIVE; None: nothing held
        self._hold = contextlib.ExitStack()

    def take(self, hold: str) -> None:
        """Hold the lock so (kept as it is when already held so)."""
        if self.hold == hold:
            return
        self.let_go()
        self._hold.enter_context(holding(self.folder, hold))
        self.hold = hold

    def let_go(self) -> None:
        self._hold.close()
        self.hold = None


class FileMarks(NamedTuple):
    """A test file's count of tests, and of those marked ``alone``, ``slow`` and ``cluster``."""

    tests: int
    alone: int
    slow: int
    cluster: int


CLUSTER_SPACING = 40
"""Slow tests, at least, in the ordinary files after each ``cluster`` file in :func:`file_order`: the other lane's
share while one runs a cluster file (the Slurm file takes 150-200 s; the three slowest ordinary files, 43 slow tests,
about as long)."""


def file_order(files: dict[Hashable, FileMarks]) -> list[Hashable]:
    """The order the lanes take the files in (``files`` in collection order, which breaks ties).

    * Files with ``alone`` tests first, those that are all ``alone`` before those that are partly: at the start both
      lanes take such files, so an ``alone`` test waits only for the other lane's ``alone`` test or a short ordinary
      one, never for a minute-long ordinary test to end (as one that comes mid-suite does).
    * Then the rest, files with more slow tests first (a file's count of them is a fair guess at its time), so the
      last files the lanes take are the small ones that even them out; each ``cluster`` file followed by ordinary
      ones with :data:`CLUSTER_SPACING` slow tests, so the other lane is on ordinary files while one runs a cluster
      file (two cluster files at once take turns test by test, each lane idle while the other's test runs).
    """

    def phase(marks: FileMarks) -> int:
        return 0 if marks.alone == marks.tests else 1 if marks.alone else 2

    ordered = sorted(files, key=lambda f: (phase(files[f]), -files[f].slow))  # stable: collection order
    rest = [f for f in ordered if phase(files[f]) == 2]
    ordinary = [f for f in rest if not files[f].cluster]
    spread: list[Hashable] = []
    for cluster in (f for f in rest if files[f].cluster):
        spread.append(cluster)
        slow = 0
        while ordinary and slow < CLUSTER_SPACING:
            slow += files[ordinary[0]].slow
            spread.append(ordinary.pop(0))
    return [f for f in ordered if phase(files[f]) < 2] + spread + ordinary
