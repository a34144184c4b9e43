"""The launcher of a virtual-time run: what :mod:`src.launch.ps` does for real processes, on the virtual clock.

It restarts a dead process after ``emulation.restart_s`` while its budget (``system.max_restarts``)
lasts: a worker (:class:`~src.virtual.worker.VirtualWorker`) from scratch, the server from its
newest checkpoint; it gives a worker the server declared failed while its process runs a grace to
rejoin by itself, and kills it as hung after it (:class:`~src.common.supervisor.RejoinGrace`); it writes
``launcher/events.jsonl`` as the real launcher does.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable

from src.common.checkpoint import unfinished_run_checkpoint
from src.common.supervisor import LaunchError, RejoinGrace, rejoin_grace_s
from src.config import Config
from src.emulation.event_loop import EventLoop
from src.metrics import EventLog
from src.virtual.worker import VirtualWorker


class VirtualLauncher:
    """The simulated launcher: restart budgets, the rejoin grace of revoked workers, the launcher's events.

    Args:
        config: the run's config (``system``: restart budget, rejoin grace, log folder).
        loop: the event loop restarts and grace expiries are scheduled on.
        restart_s: virtual seconds from a process's death to its replacement's start.
        workers: the simulated workers, by worker id.
    """

    def __init__(self, config: Config, loop: EventLoop, restart_s: float, workers: list[VirtualWorker]):
        self.config = config
        self.loop = loop
        self.clock = loop.clock
        self.restart_s = restart_s
        self.workers = workers
        self.restarts: Counter[str] = Counter()
        self.revoked = RejoinGrace(rejoin_grace_s(config.system))  # workers failed while alive: hung, or rejoining
        self.log = EventLog(Path(config.system.log_dir) / "launcher" / "events.jsonl", clock=self.clock.time)

    def publish(self, events: list) -> None:
        """A worker the server declared failed while its process still runs gets its grace to rejoin; after it, a
        process that did not is hung and killed (:class:`~src.common.supervisor.RejoinGrace`, as
        :mod:`src.launch.ps`)."""
        for kind, fields in events:
            worker = self.workers[fields["worker"]]
            if kind == "worker_failed" and worker.alive and worker.pid == fields["pid"]:
                self.revoked.failed(worker.worker_id, worker.pid, self.clock.now)
                self.loop.after(self.revoked.grace_s, self._kill_hung)
            elif kind == "worker_rejoined" and worker.worker_id in self.revoked.waiting:
                self.revoked.rejoined(worker.worker_id, fields["pid"])
                if worker.worker_id not in self.revoked.waiting:
                    self.log.write(
                        "worker_rejoined_by_itself",
                        worker=worker.worker_id,
                        pid=fields["pid"],
                        incarnation=fields["incarnation"],
                    )

    def _kill_hung(self) -> None:
        for worker_id, pid in self.revoked.due(self.clock.now):
            worker = self.workers[worker_id]
            if worker.alive and worker.pid == pid:
                self.log.write(
                    "worker_killed",
                    worker=worker_id,
                    pid=pid,
                    reason="declared failed by the server while its process was alive, and it did not rejoin (hung)",
                )
                worker.end("killed by SIGKILL")

    def _spend_restart(self, name: str) -> int | None:
        used = self.restarts[name]
        if used >= self.config.system.max_restarts:
            return None
        self.restarts[name] = used + 1
        return used + 1

    def process_ended(self, worker: VirtualWorker, exit_description: str) -> None:
        """A worker process ended abnormally: restart it after ``restart_s``, or go on without it."""
        attempt = self._spend_restart(f"worker-{worker.worker_id}")
        if attempt is None:
            self.log.write("worker_abandoned", worker=worker.worker_id, exit=exit_description)
            if not any(w.alive for w in self.workers):
                raise LaunchError(
                    f"every worker has failed and the restart budgets (system.max_restarts="
                    f"{self.config.system.max_restarts}) are spent"
                )
            return
        self.log.write("worker_restarted", worker=worker.worker_id, attempt=attempt, exit=exit_description)
        self.loop.after(self.restart_s, lambda: worker.start(faults=False))

    def server_died(self, reason: str, restart: Callable[[Path | None], None]) -> None:
        """The server process died of ``reason``: ``restart`` it from its newest checkpoint after ``restart_s``.

        Raises:
            LaunchError: the server's restart budget is spent.
        """
        attempt = self._spend_restart("server")
        if attempt is None:
            raise LaunchError(
                f"parameter server {reason}; its restart budget (system.max_restarts="
                f"{self.config.system.max_restarts}) is spent"
            )
        checkpoint = unfinished_run_checkpoint(self.config.system.checkpoint_dir, "parameter_server")
        self.log.write(
            "server_restarted", attempt=attempt, exit=reason, resumed_from=str(checkpoint) if checkpoint else None
        )
        self.loop.after(self.restart_s, lambda: restart(checkpoint))

    def close(self) -> None:
        self.log.close()
