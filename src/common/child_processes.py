"""How the framework starts its child processes: forked from a fresh server that has imported only torch.

Every launcher's child (the parameter server, a worker, a DDP rank, a benchmark's or a calibration's
process) used to be *spawned*: a fresh interpreter that imports torch again before any work, about
2.3 CPU-seconds and 3 s of wall each on this 2-core machine. A 4-worker run paid that five times.

gRPC does not survive ``fork`` once it has started (its threads and polling state are not copied
sanely), so a child is never forked from a launcher, which may hold gRPC channels. It is forked from
multiprocessing's *forkserver* instead: a fresh interpreter, started with exec like a spawned child,
that imports :data:`PRELOAD` (torch, never gRPC and never the launcher's ``__main__``) and then only
forks. Each child starts with torch already imported and does the rest as a spawned child would:
it imports the launcher's main module and the target's module, and gRPC, after the fork.

Two things a spawned child had and a forked one must be given:

* **The environment at start.** A forked child inherits the forkserver's environment, frozen when
  the server started; :class:`ChildProcess` carries the parent's ``os.environ`` as it is at
  :meth:`~ChildProcess.start` and installs it in the child before the target runs.
* **SIGINT as the launcher left it.** The forkserver restores, in each child, the SIGINT handler it
  was itself started with. Launchers start children inside
  :func:`src.common.supervisor.children_ignore_sigint`, and the forkserver starts with the first
  child, so it and every child ignore a terminal's Ctrl-C, which only the launcher handles.

:func:`process_context` is the context for :class:`multiprocessing.Process`-style children;
:func:`use_forkserver` prepares the same server for torch's ``start_processes``
(``start_method=START_METHOD``: the elastic agent, which passes each rank its environment itself).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os

from src.common.threads import idle_threads_sleep

PRELOAD = ("torch",)
"""What the forkserver imports before it forks anything: modules that never import gRPC."""

START_METHOD = "forkserver"
"""The start method for torch's ``start_processes``, after :func:`use_forkserver`."""


def use_forkserver() -> None:
    """Have the (one, per process) forkserver import :data:`PRELOAD` when it starts.

    Harmless once the server runs: it keeps what it imported at its start, which was this. The server, and so
    every child, loads torch with idle OpenMP threads sleeping (:mod:`src.common.threads`).
    """
    idle_threads_sleep()
    multiprocessing.set_forkserver_preload(list(PRELOAD))


class ChildProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the forkserver that runs with its parent's environment as of :meth:`start`."""

    def start(self) -> None:
        self._environment = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environment)
        super().run()


class _ChildContext(multiprocessing.context.ForkServerContext):
    Process = ChildProcess


def process_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context every child of the framework starts from (``Process``, ``Pipe``, ``Queue``)."""
    use_forkserver()
    return _ChildContext()
