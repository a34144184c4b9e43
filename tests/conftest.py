"""The suite's two lanes: pytest.ini runs ``-n 2 --dist loadfile`` (pytest-xdist), so two workers take test
files in turn, and a test marked ``alone`` has the machine to itself.

Most tests are CPU-bound processes that do not care what runs beside them, and on 2 cores two of them at a time
finish sooner than one after the other. Some do care: those that time something (a link's measured rate, a
virtual run calibrated against a real one), and those whose margin against a timeout is a second or two (a pause
that must end within the launcher's grace, a slow DDP rank that must never look hung). They are marked ``alone``
(a module's ``pytestmark``, or one test's mark) and run as they would in a serial run:
tests/lanes.py's lock, held from a test's first fixture set-up to its last teardown (and on to the next test when
that one is ``alone`` too). A test that runs on machinery of its own and times nothing (the Slurm cluster, the
Docker compose project, network namespaces as hosts) is marked ``cluster``: its machinery must not meet another's,
nor an ``alone`` test's clocks, but an ordinary test may run beside it (its heartbeat timeouts are an ordinary
run's). A test that detects a killed or stopped worker or shard from a 3 s heartbeat timeout, with bounds of a
second or more around it, is ordinary (tests/test_fault_tolerance.py, tests/test_shard_faults.py) or ``cluster``
(tests/test_ps_multihost.py): beside the heaviest ordinary files they took 1.0-1.2x their time alone and passed. The
lock wraps pytest-timeout's own wrapper, so a test's timeout does not count the wait. Without xdist
(``-n 0``, or ``-p no:xdist``) nothing is locked.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys

import pytest

from src.common.threads import idle_threads_sleep
from tests.lanes import CLUSTER, EXCLUSIVE, SHARED, FileMarks, LaneLock, file_order, lock_folder

# Python's default, where the environment turned it off (PYTHONDONTWRITEBYTECODE=1 on the CI machine): compiled
# modules are kept in __pycache__ (git ignores it), for pytest's rewritten test modules and for every process a
# test starts (each imports some 60 of src's modules; compiling them costs a few tenths of a second each time).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# OpenMP threads that wait for work sleep instead of spinning (libgomp spins by default): with two lanes, a
# process's spinning threads take the cores the other lane's process computes on. Measured here, two 4-worker
# virtual PS runs at once: 28.5 s and 56 CPU-s spinning, 15.0 s and 29 CPU-s passive (one alone: 11 to 12 s
# either way). It changes no result: the thread counts, and so the arithmetic, are the same. The runners and
# the framework's children do the same for themselves (src/common/threads.py); this covers the tests' own runs.
idle_threads_sleep()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order the lanes take files in (:func:`tests.lanes.file_order`; both lanes sort alike: xdist checks); a
    file's tests keep their order."""
    if not hasattr(config, "workerinput"):
        return
    by_file: dict[object, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    marks = {
        path: FileMarks(
            len(tests), *(sum(t.get_closest_marker(m) is not None for t in tests) for m in ("alone", "slow", "cluster"))
        )
        for path, tests in by_file.items()
    }
    items[:] = [item for path in file_order(marks) for item in by_file[path]]


@functools.cache
def _lane() -> LaneLock:
    """This xdist worker's lane lock (its lock files are named by the controller, the workers' parent)."""
    return LaneLock(lock_folder(os.getppid()))


def _alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not hasattr(item.config, "workerinput"):  # not an xdist worker: one lane, nothing to share
        return (yield)
    _lane().take(EXCLUSIVE if _alone(item) else CLUSTER if item.get_closest_marker("cluster") else SHARED)
    try:
        return (yield)
    finally:
        if not (_alone(item) and _alone(nextitem)):  # a run of alone tests is one hold
            _lane().let_go()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist), once every worker has ended
        shutil.rmtree(lock_folder(os.getpid()), ignore_errors=True)
