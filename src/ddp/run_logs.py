"""Where a DDP rank's events go: its own log under ``rank_<r>/``, and on rank 0 the run's log with the trackers.

Rank 0 owns the run summary, so it alone logs to the trackers (a restarted group continues their
runs); the hung-peer watchdog's ``rank_hung`` events go into this rank's log, and rank 0's into the
run's too. :meth:`RankLogs.run_start` and :meth:`RankLogs.restarted` write the events every run
begins with.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from src.config import Config
from src.ddp.job import int_env
from src.ddp.rank import RankContext
from src.ddp.watchdog import HangWatchdog
from src.metrics import MetricsLogger
from src.telemetry.trackers import open_trackers


class RankLogs:
    """This rank's log (``rank_log``) and, on rank 0, the run's (``run_log``; ``None`` elsewhere).

    Args:
        config: the run's config (``metrics.trackers``).
        context: this rank's place (rank 0 opens the run's log; a restart attempt continues the trackers' runs).
        log_dir: ``system.log_dir``.
        watchdog: this rank's hung-peer watchdog, whose events go into these logs until :meth:`close`.
        logger: where the console lines go (the trainer's, so they read as they always have).
    """

    def __init__(
        self,
        config: Config,
        context: RankContext,
        log_dir: Path,
        watchdog: HangWatchdog | None,
        logger: logging.Logger,
    ):
        self.config, self.ctx, self.watchdog, self.logger = config, context, watchdog, logger
        rank = context.rank
        tensorboard = "tensorboard" in config.metrics.trackers
        self.rank_log = MetricsLogger(log_dir / f"rank_{rank}", tensorboard=tensorboard, rank=rank)
        self.run_log = (
            MetricsLogger(
                log_dir, tensorboard=tensorboard, sinks=open_trackers(config, log_dir, resume=context.attempt > 0)
            )
            if rank == 0
            else None
        )
        self._reporters = (
            [log.event for log in (self.rank_log, self.run_log) if log is not None] if watchdog is not None else []
        )
        for reporter in self._reporters:
            watchdog.report_to(reporter)

    def run_start(self, *, comm_hook: str, resumed_from: str | None, hook_note: str | None) -> None:
        """The ``run_start`` events: this rank's (process, threads) and the run's (config, resume, hook note)."""
        ctx = self.ctx
        self.rank_log.event(
            "run_start",
            pid=os.getpid(),
            world_size=ctx.world_size,
            backend=ctx.backend,
            device=str(ctx.device),
            threads=torch.get_num_threads(),
            comm_hook=comm_hook,
            attempt=ctx.attempt,
        )
        if self.run_log is not None:
            self.run_log.event(
                "run_start",
                architecture="ddp",
                config=self.config.to_dict(),
                world_size=ctx.world_size,
                backend=ctx.backend,
                comm_hook=comm_hook,
                resumed_from=resumed_from,
                hook_note=hook_note,
                attempt=ctx.attempt,
            )
            if hook_note:
                self.logger.warning("%s", hook_note)

    def restarted(self, *, resumed_from: str | None, step: int, epoch: int, epoch_step: int) -> None:
        """The ``rank_restarted`` event: which attempt this is and where it continues from."""
        fields: dict[str, Any] = {
            "attempt": self.ctx.attempt,
            "max_restarts": int_env("TORCHELASTIC_MAX_RESTARTS"),
            "resumed_from": resumed_from,
            "step": step,
            "epoch": epoch,
            "epoch_step": epoch_step,
        }
        self.rank_log.event("rank_restarted", **fields)
        if self.run_log is not None:
            self.run_log.event("rank_restarted", **fields)
            where = f"from {resumed_from} (step {step})" if resumed_from else "from the start (no checkpoint yet)"
            budget = f"/{fields['max_restarts']}" if fields["max_restarts"] is not None else ""
            self.logger.info("restart %d%s: the group continues %s", self.ctx.attempt, budget, where)

    def close(self) -> None:
        """Stop taking the watchdog's events and close the logs."""
        for reporter in self._reporters:
            self.watchdog.forget(reporter)
        self.rank_log.close()
        if self.run_log is not None:
            self.run_log.close()
