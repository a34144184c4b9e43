"""The traces of a virtual-time run: one ``trace.json`` per simulated process, with the simulation's times.

:mod:`src.virtual.run` writes them when ``system.trace`` is on, so a virtual run's traces read as a
real run's (merged by :mod:`src.telemetry.tracing`, drawn by ``scripts/plot_trace.py``), their spans in virtual
microseconds from 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from src.config import Config
from src.telemetry.tracing import TRACE_FILE, Tracer


class VirtualTimelines:
    """``system.trace`` on the virtual clock: one ``trace.json`` per simulated process, as a real run's.

    The server's (``server/trace.json``) has its serial CPU's tasks (``apply``: a push's
    ``server_update_s``, ``reply``: ``server_reply_s``; a sharded run's ``hold`` and ``commit``) on one thread
    and each worker's parked calls (``barrier_wait``) on a thread of their own; each worker's
    (``worker_<k>/trace.json``) has ``step`` > ``forward_backward``, ``compress``, ``push``. Spans are written with
    the times the simulation decided (:meth:`src.telemetry.tracing.Tracer.complete`), so they are the cost model's,
    not the machine's; the processes get made-up pids (1: server, 2 + k: worker k). A sharded run's follower shard k has
    its own (``server_<k>/trace.json``, pid :data:`FOLLOWER_PID` + k) with the same threads.
    """

    SERVER_PID, CPU_THREAD = 1, 1
    FOLLOWER_PID = 1_000_000

    def __init__(self, config: Config, clock):
        self.enabled = config.system.trace
        self.log_dir = Path(config.system.log_dir)
        self.clock = clock
        self._tracers: dict[int, Tracer] = {}

    def _tracer(self, pid: int) -> Tracer:
        tracer = self._tracers.get(pid)
        if tracer is None:
            if pid == self.SERVER_PID:
                role, name = "server", "parameter server"
            elif pid > self.FOLLOWER_PID:
                shard = pid - self.FOLLOWER_PID
                role, name = f"server_{shard}", f"server shard {shard}"
            else:
                role, name = f"worker_{pid - 2}", f"worker {pid - 2}"
            tracer = self._tracers[pid] = Tracer(
                self.log_dir / role / TRACE_FILE, f"{name} (virtual time)", pid=pid, clock=lambda: self.clock.now
            )
        return tracer

    def server(self, name: str, start_s: float, *, calls_of: int | None = None, shard: int = 0, **args: Any) -> None:
        """A server span from ``start_s`` to now: on the CPU thread, or on the thread of worker ``calls_of``'s calls
        (``shard``: of that server shard; 0 is the parameter server)."""
        if self.enabled:
            tid, thread = (
                (self.CPU_THREAD, "cpu") if calls_of is None else (2 + calls_of, f"calls of worker {calls_of}")
            )
            self._tracer(self.SERVER_PID if shard == 0 else self.FOLLOWER_PID + shard).complete(
                name, start_s * 1e6, self.clock.now * 1e6, args or None, tid=tid, thread_name=thread
            )

    def worker(self, worker: int, name: str, start_s: float, end_s: float | None = None, **args: Any) -> None:
        """A span of worker ``worker`` from ``start_s`` to ``end_s`` (default: now)."""
        if self.enabled:
            end_s = self.clock.now if end_s is None else end_s
            self._tracer(2 + worker).complete(name, start_s * 1e6, end_s * 1e6, args or None, tid=1, thread_name="main")

    def close(self) -> None:
        for tracer in self._tracers.values():
            tracer.close()
