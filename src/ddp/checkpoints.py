"""A DDP rank's checkpoints: resuming (rank 0 reads, every rank receives), and writing them with every hook's state.

Rank 0 writes the common format (:mod:`src.common.checkpoint`) as ``checkpoint_<step>.pt`` and
``ddp_final.pt``, with every rank's hook state (residuals, step) gathered into ``extra["comm_hook"]``,
the position inside the epoch in ``extra["epoch_step"]``, the adaptive controller's state in
``extra["controller"]`` and the GradScaler's in ``extra["grad_scaler"]``. On a resume rank 0 loads
the checkpoint (a restarted attempt: this job's newest, from :class:`~src.ddp.job.JobRecord`) and
broadcasts it, so other machines need no copy of the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from src.common.checkpoint import (
    KEEP_CHECKPOINTS,
    CheckpointError,
    check_model_matches,
    load_latest_good,
    numbered_path,
    prune_checkpoints,
    save_checkpoint,
)
from src.config import Config, SetupError
from src.ddp.comm_hooks import CommHook
from src.ddp.control import RankControl
from src.ddp.job import EXPECTED_ERRORS, JobRecord
from src.ddp.rank import RankContext
from src.metrics import MetricsLogger
from src.telemetry import tracing
from src.trainer import MixedPrecision, TrainingClock, checkpoint_of_run


def check_resumable(path: str | Path, checkpoint: dict[str, Any], config: Config, world_size: int) -> None:
    """Raise :class:`SetupError` unless a run of ``config`` on ``world_size`` ranks can continue ``checkpoint``.

    The model must match; a checkpoint taken mid-epoch also needs the same ranks and batch size,
    since it continues the epoch at its next batch and any other split would read other samples.
    """
    check_model_matches(path, checkpoint, config.training.model_architecture)
    epoch_step = int(checkpoint.get("extra", {}).get("epoch_step", 0))
    if epoch_step:
        saved = (checkpoint["extra"].get("world_size"), checkpoint["config"]["training"]["batch_size"])
        here = (world_size, config.training.batch_size)
        if saved != here:
            raise SetupError(
                f"--resume {path}: taken {epoch_step} steps into epoch {int(checkpoint['epoch']) + 1} "
                f"by {saved[0]} ranks x batch {saved[1]}; this run has {here[0]} x {here[1]}, which would read other "
                f"samples: resume it "
                f"with the same ranks and batch size, or from an epoch-end checkpoint"
            )


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed rank continues: the checkpoint read, and the position and states it holds."""

    path: str
    checkpoint: dict[str, Any]

    @property
    def epoch(self) -> int:
        return int(self.checkpoint["epoch"])

    @property
    def step(self) -> int:
        return int(self.checkpoint["step"])

    @property
    def epoch_step(self) -> int:
        """Batches of :attr:`epoch` already taken (0: an epoch-end checkpoint)."""
        return int(self.checkpoint["extra"].get("epoch_step", 0))

    @property
    def controller(self) -> dict[str, Any] | None:
        return self.checkpoint["extra"].get("controller")

    @property
    def comm_hook(self) -> dict[str, Any] | None:
        return self.checkpoint["extra"].get("comm_hook")

    def restore(self, model: nn.Module, optimizer, amp: MixedPrecision) -> None:
        """Load the model, optimizer and GradScaler states into this rank's."""
        model.load_state_dict(self.checkpoint["model_state_dict"])
        optimizer.load_state_dict(self.checkpoint["optimizer_state_dict"])
        amp.load_state_dict(self.checkpoint["extra"].get("grad_scaler"))


def receive_resume_point(
    config: Config, context: RankContext, job: JobRecord, requested: str | Path | None
) -> ResumePoint | None:
    """Rank 0 loads the checkpoint to continue from and broadcasts it; ``None``: start fresh (collective).

    A restarted attempt continues from ``job``'s newest checkpoint, else from ``requested``.

    Raises:
        CheckpointError: rank 0 could not use it (on every rank, with rank 0's message).
    """
    message: list[Any] = [None]
    if context.rank == 0:
        target = (job.newest_checkpoint() or requested) if context.attempt > 0 else requested
        try:
            if target is None:
                message = [{"fresh": True}]
            else:
                path, checkpoint = load_latest_good(target)
                check_resumable(path, checkpoint, config, context.world_size)
                message = [{"path": str(path), "checkpoint": checkpoint}]
        except EXPECTED_ERRORS as exc:
            message = [{"error": str(exc)}]
    # Broadcasting (not every rank reading the file) lets other machines resume without a copy.
    dist.broadcast_object_list(message, src=0, device=context.collective_device)
    received = message[0]
    if "error" in received:
        raise CheckpointError(received["error"])
    if "fresh" in received:
        return None
    return ResumePoint(received["path"], received["checkpoint"])


def hook_restore_note(comm: CommHook, point: ResumePoint | None, context: RankContext) -> str | None:
    """Load this rank's hook state from ``point``; returns a note when it could not be used (the run goes on)."""
    if point is None:
        return None
    comm.set_step(point.step)
    if not comm.state_dict():
        return None  # a stateless exchange (allreduce, ring): nothing to restore
    saved = point.comm_hook
    if not saved:
        return "checkpoint has no comm hook state; the hook starts fresh"
    if saved.get("name") != comm.name:
        return f"checkpoint's comm hook is {saved.get('name')!r}, this run uses {comm.name!r}; the hook starts fresh"
    if saved.get("world_size") != context.world_size:
        return (
            f"checkpoint has hook state for {saved.get('world_size')} ranks, this run has {context.world_size}; "
            f"the hook starts fresh"
        )
    try:
        comm.load_state_dict(saved["ranks"][context.rank])
    except ValueError as exc:  # e.g. error feedback switched off since the checkpoint
        return f"{exc}; the hook starts fresh"
    return None


class RankCheckpoints:
    """Writes this run's checkpoints (collective: every rank's hook state is gathered to rank 0, which writes).

    Args:
        config: the run's config (``system.checkpoint_dir``, ``training.checkpoint_interval_steps``).
        context: this rank's place.
        job: the elastic job's record, told of every checkpoint written.
        model, optimizer, amp, comm, control: what a checkpoint holds beside the position.
    """

    def __init__(
        self,
        config: Config,
        context: RankContext,
        job: JobRecord,
        *,
        model: nn.Module,
        optimizer,
        amp: MixedPrecision,
        comm: CommHook,
        control: RankControl | None,
    ):
        self.config, self.ctx, self.job = config, context, job
        self.directory = Path(config.system.checkpoint_dir)
        self.model, self.optimizer, self.amp, self.comm, self.control = model, optimizer, amp, comm, control

    def save(self, path: Path, *, step: int, epoch: int, epoch_step: int = 0) -> Path:
        """Write a checkpoint at optimizer step ``step`` (collective: every rank's hook state is gathered to rank 0)."""
        with tracing.span("checkpoint", step=step):
            states: list[Any] | None = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
            dist.gather_object(self.comm.state_dict(), states, dst=0)
            if self.ctx.rank == 0:
                checkpoint = checkpoint_of_run(
                    self.config,
                    self.model,
                    self.optimizer,
                    epoch=epoch,
                    step=step,
                    extra={
                        "comm_hook": {"name": self.comm.name, "world_size": self.ctx.world_size, "ranks": states},
                        "epoch_step": epoch_step,
                        "world_size": self.ctx.world_size,
                        "controller": self.control.state_dict() if self.control is not None else None,
                        "grad_scaler": self.amp.state_dict(),
                    },
                )
                save_checkpoint(path, checkpoint)
                self.job.checkpoint_written(path)
        return path

    def save_numbered(
        self, run_log: MetricsLogger | None, clock: TrainingClock, *, step: int, epoch: int, epoch_step: int
    ) -> None:
        """``checkpoint_<step>.pt`` with the clock stopped; rank 0 prunes the old ones and logs it."""
        with clock.paused():
            written = self.save(numbered_path(self.directory, step), step=step, epoch=epoch, epoch_step=epoch_step)
            if run_log is not None:
                prune_checkpoints(self.directory, KEEP_CHECKPOINTS)
                run_log.event("checkpoint", path=str(written), epoch=epoch, epoch_step=epoch_step, step=step)

    def step_checkpoint_due(self, step: int) -> bool:
        """Whether ``training.checkpoint_interval_steps`` asks for a checkpoint after step ``step``."""
        interval = self.config.training.checkpoint_interval_steps
        return interval > 0 and step % interval == 0
