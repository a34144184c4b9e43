"""A discrete-event loop on a virtual clock, and the two shared resources a simulated cluster queues for.

Pure: no torch, no I/O, no threads. :mod:`src.virtual.run` runs a parameter-server job on it.

* :class:`EventLoop`: callbacks ordered by (time, order of scheduling), so two runs of the same
  events happen in the same order: a simulation is deterministic whatever the machine's load.
* :class:`SharedLink`: one direction of a NIC that concurrent transfers share *max-min fairly*
  (each transfer also capped by its own link's rate, e.g. a worker's 25 Mbit/s uplink): while k
  transfers are active and none is capped, each gets capacity / k; a capped one leaves its unused
  share to the others. Rates are recomputed whenever a transfer starts or ends, so 32 workers
  pushing 23 MB into a 1 Gbit/s server NIC queue as they would on a real network.
* :class:`SerialServer`: one CPU doing one task at a time, in order (the parameter server's lock).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Callable

from src.common.clock import VirtualClock


class EventLoop:
    """Callbacks at virtual times; :meth:`run` processes them in order, advancing ``clock``."""

    def __init__(self, clock: VirtualClock | None = None):
        self.clock = clock or VirtualClock()
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.processed = 0

    @property
    def now(self) -> float:
        return self.clock.now

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at virtual time ``when`` (not before now)."""
        heapq.heappush(self._queue, (max(when, self.clock.now), next(self._order), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self.at(self.clock.now + max(delay, 0.0), callback)

    def run(self, until: Callable[[], bool]) -> bool:
        """Process events until ``until()`` holds (``True``) or none is left (``False``)."""
        while not until():
            if not self._queue:
                return False
            when, _, callback = heapq.heappop(self._queue)
            self.clock.advance_to(when)
            callback()
            self.processed += 1
        return True


class SharedLink:
    """One direction of a NIC of ``capacity_bps`` (``None``: not limited) shared by concurrent transfers.

    :meth:`send` starts a transfer of ``bits`` capped at ``cap_bps`` (``None``: only the NIC limits
    it) and calls ``done`` when its last bit is through. Seconds spent are returned by nothing: the
    caller reads the loop's clock in ``done``.
    """

    EPSILON_BITS = 1e-3  # a transfer this close to its end is done (float rounding of rate * time)

    def __init__(self, loop: EventLoop, capacity_bps: float | None):
        self.loop = loop
        self.capacity_bps = capacity_bps
        self._flows: dict[int, list] = {}  # id -> [remaining bits, cap bps, done, rate]
        self._ids = itertools.count()
        self._updated = 0.0
        self._timer = 0  # generation of the pending completion event

    @property
    def active(self) -> int:
        return len(self._flows)

    def send(self, bits: float, cap_bps: float | None, done: Callable[[], None]) -> None:
        if bits <= 0 or (self.capacity_bps is None and cap_bps is None):
            self.loop.after(0.0, done)  # nothing limits it: through at once
            return
        if self.capacity_bps is None:  # only its own link limits it: nothing to share
            self.loop.after(bits / cap_bps, done)
            return
        self._advance()
        self._flows[next(self._ids)] = [float(bits), cap_bps, done, 0.0]
        self._reschedule()

    def _advance(self) -> None:
        elapsed = self.loop.now - self._updated
        if elapsed > 0:
            for flow in self._flows.values():
                flow[0] -= flow[3] * elapsed
        self._updated = self.loop.now

    def _reschedule(self) -> None:
        """Max-min fair rates for the active transfers, and an event at the next one's end."""
        remaining_capacity, left = self.capacity_bps, len(self._flows)
        for flow in sorted(self._flows.values(), key=lambda f: float("inf") if f[1] is None else f[1]):
            share = remaining_capacity / left
            flow[3] = share if flow[1] is None else min(flow[1], share)
            remaining_capacity -= flow[3]
            left -= 1
        self._timer += 1
        if self._flows:
            soonest = min(max(f[0], 0.0) / f[3] for f in self._flows.values())
            generation = self._timer
            self.loop.after(soonest, lambda: self._complete(generation))

    def _complete(self, generation: int) -> None:
        if generation != self._timer:
            return  # rates changed since this event was scheduled
        self._advance()
        finished = [key for key, flow in self._flows.items() if flow[0] <= self.EPSILON_BITS]
        if not finished:  # rounding left a sliver: the soonest transfer is the one that ended
            finished = [min(self._flows, key=lambda key: self._flows[key][0] / self._flows[key][3])]
        callbacks = [self._flows.pop(key)[2] for key in finished]
        self._reschedule()
        for callback in callbacks:
            callback()


class SerialServer:
    """One CPU: tasks of known duration run one after another; each task's action runs at its end.

    :meth:`submit` with ``first=True`` puts a task at the head of the queue (work the current task
    holds the lock for, such as the reply that follows a push). :meth:`reset` drops everything (the
    process died).
    """

    def __init__(self, loop: EventLoop):
        self.loop = loop
        self._queue: deque[tuple[float, Callable[[], None]]] = deque()
        self._busy = False
        self._generation = 0
        self.busy_s = 0.0

    def submit(self, seconds: float, action: Callable[[], None], *, first: bool = False) -> None:
        (self._queue.appendleft if first else self._queue.append)((seconds, action))
        if not self._busy:
            self._next()

    def _next(self) -> None:
        if not self._queue:
            self._busy = False
            return
        self._busy = True
        seconds, action = self._queue.popleft()
        self.busy_s += seconds
        generation = self._generation

        def finish() -> None:
            if generation != self._generation:
                return
            action()
            if generation == self._generation:  # the action did not reset the server
                self._next()

        self.loop.after(seconds, finish)

    def reset(self) -> None:
        self._queue.clear()
        self._busy = False
        self._generation += 1
