"""Idle OpenMP threads that sleep instead of spinning, in the processes the framework starts.

torch's CPU kernels run on libgomp (GNU OpenMP) here. Unless ``OMP_WAIT_POLICY`` says otherwise, a libgomp
thread that has finished its share of a parallel region spins for a while before it sleeps. Alone on its
cores that costs nothing; beside other busy threads (a server and N workers on shared cores, two virtual runs
at once, the test suite's two lanes) the spinning threads hold the cores the others wait for. Measured on this
2-core VM, the README's 4-worker virtual command on mnist_5k (1 epoch), two runs at once: 9.7 and 13.7 s
spinning, 7.7 and 7.7 s with ``OMP_WAIT_POLICY=PASSIVE``; one run alone 6.1 and 6.0 s spinning, 6.0 and 5.8 s
passive (no loss).

libgomp reads the variable once, when it is loaded with torch, so :func:`idle_threads_sleep` must run before
torch is imported to hold in this process; every child started after it inherits it. A value the user set
is kept.
"""

from __future__ import annotations

import os

VARIABLE = "OMP_WAIT_POLICY"
POLICY = "PASSIVE"


def idle_threads_sleep() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` for this process (if torch is not loaded yet) and its children, unless set."""
    os.environ.setdefault(VARIABLE, POLICY)
