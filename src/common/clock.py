"""Where a run's time comes from: the machine's clocks, or a virtual clock that a simulation advances.

The parameter server's core (:mod:`src.ps.server.core`), its event logs and its summary read time only
through a :class:`Clock`, so the same code runs on the wall clock (real processes, real waits) and
on a :class:`VirtualClock` (:mod:`src.virtual.run`: one process, where time is computed by a cost
model and moves only when the simulation says so).

* ``monotonic()``: seconds for intervals (heartbeat silence, timeouts).
* ``time()``: seconds since an epoch, for timestamps that must mean the same across processes and
  restarts (event times, the training clock a resumed server continues).
"""

from __future__ import annotations

import time
from typing import Literal


class Clock:
    """The machine's clocks (``time.monotonic`` and ``time.time``)."""

    kind: Literal["real", "virtual"] = "real"

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class VirtualClock(Clock):
    """A clock that stands still until :meth:`advance_to` moves it; both readings are the same seconds from 0."""

    kind: Literal["real", "virtual"] = "virtual"

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def advance_to(self, when: float) -> None:
        """Move to ``when`` (never backwards: events are processed in time order)."""
        if when < self.now:
            raise ValueError(f"virtual time cannot go back from {self.now} to {when}")
        self.now = when


REAL_CLOCK = Clock()
"""The one real clock every process uses unless a simulation gives it another."""
