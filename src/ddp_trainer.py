"""One rank of ring-allreduce data parallelism: DistributedDataParallel over torch.distributed.

Ranks are started by :mod:`src.launch.ddp` (locally through torch's elastic agent, or by
torchrun across machines); :func:`run_rank` joins the process group, trains with
:class:`DDPTrainer` and leaves the group. gloo on CPU, nccl when the device is CUDA
(``system.backend`` overrides). Each rank gets ``cores // local ranks`` intra-op threads so N ranks
do not oversubscribe the machine.

Data: rank r of N reads ``make_shards(len(train), N, epoch, seed)[r]`` in batches of
``training.batch_size``. Step i of all ranks together then reads exactly the samples the baseline
reads at its step i with batch ``N * batch_size``. The loss on each rank is its per-sample loss sum
times ``N / (samples in the step across all ranks)``, so DDP's average over ranks is exactly the
large-batch mean even when the last step's batches are short or uneven. Every rank takes
``steps_per_epoch`` steps; a rank whose shard ran out takes an empty step (zero gradient, same
collectives) instead of using ``Join``: explicit, deterministic, and it keeps the comm hooks' step
counters in lock-step.

Gradient exchange: :mod:`src.ddp.comm_hooks` (built-in allreduce, ring hook, compressed hooks).
Evaluation: after every epoch, and every ``training.eval_interval`` steps when set, each rank scores
its slice ``r::N`` of the test split and the sums are all-reduced, so every rank knows the accuracy;
the first evaluation at ``training.target_accuracy`` gives the time to target. Time is a
:class:`src.trainer.TrainingClock` (from the first training step; evaluation and checkpoints excluded).
Adaptive compression (``system.adaptive_compression``, top-k only, needs ``training.eval_interval``):
:mod:`src.ddp.control`: rank 0's controller decides at every evaluation from the eval loss and its
steps' timings, the decision is broadcast, and every rank switches its hook's top-k ratio at the
same step (``controller`` events at the top level, ``control_applied`` in every rank's log, the
summary's ``controller`` entry).

Checkpoints: rank 0 writes the common format as ``checkpoint_<step>.pt`` (numbered by optimizer
step) every ``checkpoint_interval`` epochs and every ``checkpoint_interval_steps`` steps (mid-epoch
too), and ``ddp_final.pt``, with every rank's hook state (residuals, step) gathered into
``extra["comm_hook"]``, the position inside the epoch in ``extra["epoch_step"]`` and the adaptive
controller's state in ``extra["controller"]``. ``--resume`` has rank 0 load the checkpoint and
broadcast it (other machines need no copy of the file); a mid-epoch checkpoint continues the same
epoch at the next batch, so the data order, the hook state and the controller continue exactly.

Mixed precision (``training.amp``): :class:`src.trainer.MixedPrecision` around each step's forward
pass; under fp16 every rank's GradScaler sees the same averaged gradients and skips the same steps;
its state is checkpointed in ``extra["grad_scaler"]``. An emulated straggler (``emulation``,
``slowdown`` / ``step_delay_s`` per rank) waits :class:`src.emulation.netem.ComputeDelay` after each backward.

Hung ranks: :func:`run_rank` starts a :class:`src.ddp.watchdog.HangWatchdog` (heartbeats in the
agent's store) and, once set up, limits every collective to ``system.collective_timeout_s``; a hung
peer ends the attempt, which the agent then restarts like one whose rank died.

Restarts: when the elastic agent restarts the group after a rank died (``TORCHELASTIC_RESTART_COUNT``
> 0), rank 0 resumes from the newest checkpoint this job wrote, which :class:`JobRecord` keeps in
the agent's store (so an older job's checkpoints in the same folder are never taken), and logs
``rank_restarted``. Faults (``system.inject_faults``, ``kill:rank=R@step=N``) fire in the first
attempt only. An expected error (missing dataset, unusable checkpoint, bad value) is recorded there
too, so later attempts stop at once instead of repeating a run that cannot succeed.

Exposed communication (:mod:`src.telemetry.exposed_comm`): each step's wait at the end of the backward pass
for the gradient exchange, from the last gradient computed to ``backward()``'s return, as
``exposed_communication_s`` in the train scalars and the summaries (per rank; summed over ranks in
the run summary). Timeline spans (``--trace``): ``step`` > ``forward_backward`` (>
``exchange_wait``), ``optimizer_step``; ``evaluate``; ``checkpoint``; and each bucket's
``hook_exchange`` on the comm hook's thread (:mod:`src.ddp.comm_hooks`).

Outputs under ``system.log_dir``: ``summary.json`` (rank 0, whole run), ``ddp_rank_<r>.json`` (per
rank: samples, time, bytes), and per-rank TensorBoard + ``events.jsonl`` under ``rank_<r>/``; rank 0
also logs run-level events (eval, checkpoints, restarts) at the top level.

:class:`DDPTrainer` owns the epoch loop and hands the rest to its collaborators: the rank's place
and set-up checks (:mod:`src.ddp.rank`), the job's record across restarts (:mod:`src.ddp.job`),
resume and checkpoints (:mod:`src.ddp.checkpoints`), evaluation (:mod:`src.ddp.evaluation`), the
logs (:mod:`src.ddp.run_logs`) and the summaries (:mod:`src.ddp.summary`).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.common.checkpoint import final_checkpoint_path
from src.common.faults import FaultInjector
from src.common.supervisor import LaunchError, leave_process
from src.config import Config, SetupError
from src.ddp.checkpoints import RankCheckpoints, ResumePoint, hook_restore_note, receive_resume_point
from src.ddp.comm_hooks import CommHook, comm_hook_from_config
from src.ddp.control import RankControl, config_problem
from src.ddp.evaluation import RankEvaluation
from src.ddp.job import EXPECTED_ERRORS, JobRecord, int_env
from src.ddp.rank import RankContext, check_rank_setup, rank_device, select_backend, threads_per_rank
from src.ddp.run_logs import RankLogs
from src.ddp.summary import rank_and_run_summaries, run_description
from src.ddp.watchdog import HangWatchdog
from src.emulation import netem
from src.metrics import LOG_EVERY_STEPS, MetricsLogger, TimeToTarget, write_summary
from src.telemetry import tracing
from src.telemetry.exposed_comm import BackwardWait
from src.trainer import (
    MixedPrecision,
    TrainingClock,
    epoch_evaluation_due,
    eval_due,
    load_splits,
    model_from_config,
    optimizer_from_config,
    progress,
    samples_due,
)
from src.training.data import make_shards, steps_per_epoch
from src.training.lr_schedule import set_scheduled_learning_rate

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the trainer


def _scaled_loss(
    logits: torch.Tensor, labels: torch.Tensor, world_size: int, step_samples: int
) -> tuple[torch.Tensor, float, int]:
    """Loss whose DDP average over ranks is the mean over all ``step_samples`` of the step."""
    total = F.cross_entropy(logits, labels, reduction="sum")
    correct = int((logits.detach().argmax(dim=1) == labels).sum())
    local_mean = float(total.detach()) / max(len(labels), 1)
    return total * (world_size / step_samples), local_mean, correct


class _SilentBar:
    """Progress bar of the ranks other than 0 (one bar per job is enough)."""

    def update(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _StepRecord:
    """What one training step of this rank did, for its ``train`` scalars."""

    samples: int
    loss: float
    correct: int
    step_time_s: float
    gradient_time_s: float
    communication_time_s: float
    exposed_communication_s: float
    bytes_sent: int
    dense_bytes: int
    payload_bytes: int


class DDPTrainer:
    """One rank of a DDP run; the process group must already be initialized.

    Args:
        config: validated config (``system.num_workers`` is informational here; the group decides).
        context: this rank's place, backend, device and restart attempt.
        resume: checkpoint file or folder to continue from (rank 0 reads it and broadcasts it). A
            restarted attempt continues from ``job``'s newest checkpoint instead, when there is one.
        summary_json: run summary path (default ``<log_dir>/summary.json``), written by rank 0.
        comm_hook: factory ``(module) -> CommHook`` replacing the config's choice (benchmarks, tests).
        job: the elastic job's shared record (newest checkpoint); default: none.
        watchdog: this rank's hung-peer watchdog (:mod:`src.ddp.watchdog`), whose ``rank_hung``
            events go into this run's logs; default: none.
    """

    def __init__(
        self,
        config: Config,
        context: RankContext,
        *,
        resume: str | Path | None = None,
        summary_json: str | Path | None = None,
        comm_hook: Callable[[nn.Module], CommHook] | None = None,
        job: JobRecord | None = None,
        watchdog: HangWatchdog | None = None,
    ):
        problem = config_problem(config)
        if problem is not None:
            raise SetupError(problem)
        check_rank_setup(config, context.world_size)
        self.config = config
        self.ctx = context
        self.job = job or JobRecord()
        self.watchdog = watchdog
        self.log_dir = Path(config.system.log_dir)
        self.summary_json = Path(summary_json) if summary_json else self.log_dir / "summary.json"
        self.train_set, test_set = load_splits(config)
        self.evaluation = RankEvaluation(test_set, context, config.training.eval_batch_size)
        self.model = model_from_config(config).to(context.device)
        self.optimizer = optimizer_from_config(config, self.model.parameters())
        self.amp = MixedPrecision(config.training.amp, context.device)
        # An emulated straggler (emulation.workers[rank]): each step's compute stretched, as a PS worker's.
        self.compute_delay = netem.ComputeDelay(
            netem.conditions_for(config.emulation, context.rank), netem.worker_seed(config.training.seed, context.rank)
        )
        self.start_epoch, self.start_index, self.step, self.steps_run = 0, 0, 0, 0
        self.resumed_from: str | None = None
        self.faults = FaultInjector(config.system.inject_faults, "rank", context.rank, enabled=context.attempt == 0)
        point = None
        if resume is not None or context.attempt > 0:
            point = receive_resume_point(config, context, self.job, resume)
        if point is not None:
            point.restore(self.model, self.optimizer, self.amp)
            self.start_epoch, self.step, self.start_index = point.epoch, point.step, point.epoch_step
            self.resumed_from = point.path
        device_ids = [context.device.index] if context.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        self.comm = (
            comm_hook(self.model)
            if comm_hook is not None
            else comm_hook_from_config(config.system, self.model, seed=config.training.seed)
        )
        self.comm.register(self.ddp)
        self.hook_note = hook_restore_note(self.comm, point, context)
        self.control = self._adaptive_control(point)
        self.checkpoints = RankCheckpoints(
            config,
            context,
            self.job,
            model=self.model,
            optimizer=self.optimizer,
            amp=self.amp,
            comm=self.comm,
            control=self.control,
        )
        # DDP re-buckets after a process's first backward pass; a silent one now makes every
        # training step see the final buckets (the compression units; see src.ddp.hook_state).
        self.comm.settle_buckets(self.ddp, self.train_set.images[:1].to(context.device))
        self.backward_wait = BackwardWait(self.model)  # exposed communication (src/telemetry/exposed_comm.py)

    def _adaptive_control(self, point: ResumePoint | None) -> RankControl | None:
        """Adaptive compression (src/ddp/control.py): rank 0's controller decides at evaluations, every
        rank sets its hook's top-k ratio from the same step; ``None`` without ``system.adaptive_compression``."""
        if not self.config.system.adaptive_compression:
            return None
        if self.comm.topk_ratio is None:
            raise SetupError(
                f"system.adaptive_compression sets top-k's Active Fraction: the comm hook {self.comm.name!r} "
                f"does not compress with top-k"
            )
        control = RankControl.for_run(
            self.config.system,
            self.ctx.rank,
            compression_ratio=self.comm.topk_ratio,
            saved=point.controller if point is not None else None,
        )
        if control.compression_ratio != self.comm.topk_ratio:  # resumed: the ratio in effect at the checkpoint
            self.comm.set_topk_ratio(control.compression_ratio)
        return control

    def close(self) -> None:
        """Stop the comm hook's exchange thread and let go of DDP (before the group is destroyed).

        (torch keeps gloo's own threads alive even so; see :func:`leave_rank_process`.)
        """
        closer = getattr(self.comm, "close", None)
        if callable(closer):
            closer()
        self.backward_wait.close()
        self.ddp = self.comm = self.checkpoints = None
        gc.collect()

    # -- the loop -------------------------------------------------------------------------

    def _evaluate_and_log(
        self, run_log: MetricsLogger | None, epoch: int, clock: TrainingClock, target: TimeToTarget
    ) -> tuple[float, float]:
        return self.evaluation.evaluate_and_log(self.model, self.step, run_log, epoch, clock, target, self.control)

    def _train_epoch(
        self, epoch: int, first_index: int, logs: RankLogs, clock: TrainingClock, target: TimeToTarget
    ) -> tuple[int, int]:
        """Epoch ``epoch`` of this rank's shard from batch ``first_index`` on; returns (samples, steps)."""
        t = self.config.training
        world = self.ctx.world_size
        num_train = len(self.train_set)
        per_step = t.batch_size * world
        num_steps = steps_per_epoch(num_train, world, t.batch_size)
        batches = list(make_shards(num_train, world, epoch, t.seed)[self.ctx.rank].batches(t.batch_size))
        batches += [[]] * (num_steps - len(batches))  # shard ran out: empty steps, same collectives
        samples = 0
        bar = (
            progress(num_steps - first_index, f"epoch {epoch + 1}/{t.num_epochs}")
            if self.ctx.rank == 0
            else _SilentBar()
        )
        for index in range(first_index, num_steps):
            if self.control is not None:
                self._follow_control(logs.rank_log)
            step_samples = min(per_step, num_train - index * per_step)  # all ranks together, this step
            record = self._train_step(batches[index], step_samples)
            samples += record.samples
            epoch_end = index + 1 == num_steps
            if self.step % LOG_EVERY_STEPS == 0 or epoch_end:
                self._log_step(logs.rank_log, epoch, record, samples)
            if not epoch_end:  # the epoch's end has its own evaluation and checkpoint
                # all ranks together, from the epoch's start: the same count on every rank (and after a resume)
                done = epoch * num_train + min((index + 1) * per_step, num_train)
                if eval_due(self.step, t.eval_interval, epoch_end=False) or samples_due(
                    done - step_samples, done, t.eval_every_samples
                ):
                    self._evaluate_and_log(logs.run_log, epoch, clock, target)
                if self.checkpoints.step_checkpoint_due(self.step):
                    self.checkpoints.save_numbered(
                        logs.run_log, clock, step=self.step, epoch=epoch, epoch_step=index + 1
                    )
            bar.update()
            self.faults.reached(self.steps_run)  # a real SIGKILL, after the step and its checkpoint
        bar.close()
        return samples, num_steps - first_index

    def _train_step(self, indices: list[int], step_samples: int) -> _StepRecord:
        """One optimizer step of this rank on the samples ``indices`` (DDP averages the gradients over ranks)."""
        device, stats = self.ctx.device, self.comm.stats
        step_started = time.perf_counter()
        sent_before, hook_before = stats.total_sent, stats.hook_seconds
        dense_before, payload_before = stats.dense_bytes, stats.payload_bytes
        images, labels = self.train_set.batch(indices)
        images, labels = images.to(device), labels.to(device)
        self.optimizer.zero_grad(set_to_none=True)
        with tracing.span("forward_backward", step=self.step + 1):
            with self.amp.autocast():
                loss, local_loss, correct = _scaled_loss(self.ddp(images), labels, self.ctx.world_size, step_samples)
            self.backward_wait.backward_started()
            self.amp.backward(loss)
            exposed = self.backward_wait.backward_ended(time.perf_counter())  # DDP's wait for the exchange
            if self.compute_delay.active:
                self.compute_delay.after_step(time.perf_counter() - step_started)
        gradient_time = time.perf_counter() - step_started
        # training.lr_schedule, the same on every rank
        set_scheduled_learning_rate(self.optimizer, self.config.training, self.step)
        with tracing.span("optimizer_step", step=self.step + 1):
            self.amp.step(self.optimizer)  # fp16: skipped on every rank alike (the same averaged gradients)
        self.comm.end_step()
        step_time = time.perf_counter() - step_started
        if self.control is not None:
            self.control.step_done(
                step_time,
                stats.hook_seconds - hook_before,
                stats.payload_bytes - payload_before,
                stats.dense_bytes - dense_before,
            )
        self.step += 1
        self.steps_run += 1
        tracing.record("step", step_started, time.perf_counter(), step=self.step)
        return _StepRecord(
            samples=len(labels),
            loss=local_loss,
            correct=correct,
            step_time_s=step_time,
            gradient_time_s=gradient_time,
            communication_time_s=stats.hook_seconds - hook_before,
            exposed_communication_s=exposed,
            bytes_sent=stats.total_sent - sent_before,
            dense_bytes=stats.dense_bytes - dense_before,
            payload_bytes=stats.payload_bytes - payload_before,
        )

    def _log_step(self, rank_log: MetricsLogger, epoch: int, record: _StepRecord, samples: int) -> None:
        """The ``train`` scalars of the step just taken (``samples``: this rank's, from the epoch's start)."""
        compression = {}
        if self.config.system.compression_enabled:
            payload = record.payload_bytes
            compression["compression_ratio"] = record.dense_bytes / payload if payload else None
        rank_log.scalars(
            "train",
            self.step,
            {
                "loss": record.loss,
                "accuracy": record.correct / max(record.samples, 1),
                "throughput": record.samples / record.step_time_s,
                "gradient_time_s": record.gradient_time_s,  # forward + backward, the overlapped exchange included
                "communication_time_s": record.communication_time_s,
                "exposed_communication_s": record.exposed_communication_s,
                "step_time_s": record.step_time_s,
                "bytes_sent": record.bytes_sent,
                "samples_processed": samples,
                **compression,
            },
            epoch=epoch,
        )

    def _follow_control(self, rank_log: MetricsLogger) -> None:
        """Before step ``self.step + 1``: switch the hook's top-k ratio if a decision applies from it.

        (On every rank alike: the decision was broadcast.)
        """
        previous = self.control.compression_ratio
        switch = self.control.due(self.step + 1)
        if switch is not None:
            self.comm.set_topk_ratio(switch.rho)
            rank_log.event(
                "control_applied",
                step=self.step + 1,
                compression_ratio=switch.rho,
                previous_compression_ratio=previous,
                max_staleness=switch.max_staleness,
            )

    def run(self) -> dict[str, Any]:
        """Train, evaluate and checkpoint; returns the run summary (every rank returns the same one)."""
        started = time.perf_counter()
        clock, target = TrainingClock(), TimeToTarget(self.config.training.target_accuracy)
        logs = RankLogs(self.config, self.ctx, self.log_dir, self.watchdog, logger)
        try:
            logs.run_start(comm_hook=self.comm.name, resumed_from=self.resumed_from, hook_note=self.hook_note)
            if self.ctx.attempt > 0:
                logs.restarted(
                    resumed_from=self.resumed_from, step=self.step, epoch=self.start_epoch, epoch_step=self.start_index
                )
            samples, steps_run, final_loss, final_accuracy = self._train_epochs(logs, clock, target)
            checkpoint_path = self.checkpoints.save(
                final_checkpoint_path(self.checkpoints.directory, "ddp"),
                step=self.step,
                epoch=max(self.config.training.num_epochs, self.start_epoch),
            )
            common = {
                **run_description(self.config, self.ctx, self.comm.name),
                "final_accuracy": final_accuracy,
                "final_loss": final_loss,
                "checkpoint_path": str(checkpoint_path),
                "steps": self.step,
                "steps_this_run": steps_run,
                "restarts": self.ctx.attempt,
                "resumed_from": self.resumed_from,
                "clock": "real",
                "training_clock": TrainingClock.DESCRIPTION,
                "controller": self.control.summary() if self.control is not None else None,
                **target.fields(),
            }
            return self._write_summaries(logs, common, samples, clock.seconds, steps_run, started, checkpoint_path)
        except RuntimeError:
            # A collective timed out (or failed) before the watchdog's own verdict: a silent peer is
            # the hung one (logged here; this process then ends, see src.ddp.watchdog), else re-raise.
            if self.watchdog is not None:
                self.watchdog.collective_failed()
            raise
        finally:
            logs.close()

    def _train_epochs(
        self, logs: RankLogs, clock: TrainingClock, target: TimeToTarget
    ) -> tuple[int, int, float, float]:
        """The epochs from where this run starts; returns (samples, steps, final test loss, final test accuracy)."""
        t = self.config.training
        samples, steps_run = 0, 0
        final_loss, final_accuracy = self.evaluation.evaluate(self.model)
        self.ddp.train()
        for epoch in range(self.start_epoch, t.num_epochs):
            first_index = self.start_index if epoch == self.start_epoch else 0
            with clock.running():
                epoch_samples, epoch_steps = self._train_epoch(epoch, first_index, logs, clock, target)
            samples, steps_run = samples + epoch_samples, steps_run + epoch_steps
            if epoch_evaluation_due(t, epoch):  # every rank decides alike: the evaluation is collective
                final_loss, final_accuracy = self._evaluate_and_log(logs.run_log, epoch + 1, clock, target)
                if logs.run_log is not None:
                    result = (epoch + 1, t.num_epochs, final_accuracy * 100, final_loss)
                    logger.info("epoch %d/%d: test accuracy %.2f%%, test loss %.4f", *result)
            if (
                (epoch + 1) % t.checkpoint_interval == 0
                or epoch + 1 == t.num_epochs
                or self.checkpoints.step_checkpoint_due(self.step)
            ):
                self.checkpoints.save_numbered(logs.run_log, clock, step=self.step, epoch=epoch + 1, epoch_step=0)
        return samples, steps_run, final_loss, final_accuracy

    def _write_summaries(
        self,
        logs: RankLogs,
        common: dict[str, Any],
        samples: int,
        train_time: float,
        steps_run: int,
        started: float,
        checkpoint_path: Path,
    ) -> dict[str, Any]:
        """This rank's summary and (rank 0) the run's, logged and written; returns the run's (collective)."""
        rank_summary, summary = rank_and_run_summaries(
            common,
            self.ctx,
            self.comm.stats,
            samples=samples,
            train_time=train_time,
            steps_run=steps_run,
            total_time=time.perf_counter() - started,
            exposed_communication_s=self.backward_wait.total_s,
            emulated_delay_s=self.compute_delay.delay_s,
            amp=self.amp.summary(),
        )
        logs.rank_log.event("run_end", **{k: v for k, v in rank_summary.items() if k != "rank"})
        write_summary(self.log_dir / f"ddp_rank_{self.ctx.rank}.json", rank_summary)
        if logs.run_log is not None:
            logs.run_log.event("run_end", **summary)
            write_summary(self.summary_json, summary)
            logs.run_log.finish(summary, artifacts=[self.summary_json, checkpoint_path])
        self.rank_summary = rank_summary
        return summary


# ----------------------------------------------------------------------------- one rank's life


def leave_rank_process(code: int) -> NoReturn:
    """End a rank process with ``code`` once its outputs are flushed, skipping interpreter shutdown.

    Once DDP has run, torch keeps the gloo process group, and its threads, alive after
    ``destroy_process_group`` (measured: its three gloo threads are still there after DDP is
    deleted and the garbage collected); see :func:`src.common.supervisor.leave_process`.
    """
    leave_process(code)


SETUP_TIMEOUT_S = 300.0
"""What a collective may wait while the group joins and sets up (loading data, restoring a checkpoint,
DDP's first broadcast), when ranks start unevenly; training collectives wait ``system.collective_timeout_s``."""


def _hang_watchdog(job: JobRecord, attempt: int, rank: int, world_size: int, timeout_s: float) -> HangWatchdog | None:
    """This rank's watchdog over its peers' heartbeats, on its own connection to the agent's store.

    ``None`` without an agent's store.
    """
    if job.store is None:
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=max(10.0, timeout_s)),
    )
    return HangWatchdog(
        dist.PrefixStore(f"attempt_{attempt}/watchdog", client), rank, world_size, timeout_s, leave=leave_rank_process
    ).start()


def run_rank(
    config: Config,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    store: dist.Store | None = None,
    resume: str | Path | None = None,
    summary_json: str | Path | None = None,
) -> dict[str, Any]:
    """Join the process group as ``rank``, train, and leave the group (also on errors).

    The restart attempt comes from ``TORCHELASTIC_RESTART_COUNT`` (set by the elastic agent). Under
    an elastic agent a :class:`~src.ddp.watchdog.HangWatchdog` watches the peers' heartbeats, and
    training collectives wait at most ``system.collective_timeout_s``: a hung rank fails the attempt
    (see :mod:`src.ddp.watchdog`).

    Args:
        store: rendezvous store; ``None`` joins through the elastic agent's store (``MASTER_ADDR``/
            ``MASTER_PORT``), with its keys kept apart per restart attempt.

    Returns:
        The run summary.

    Raises:
        LaunchError: an earlier attempt of this job stopped on an expected error (it would again).
    """
    attempt = int_env("TORCHELASTIC_RESTART_COUNT") or 0
    job = JobRecord.from_environment()
    fatal = job.fatal_error() if attempt > 0 else None
    if fatal is not None:
        raise LaunchError(f"{fatal} (an earlier attempt stopped on this; not retrying)")
    timeout_s = config.system.collective_timeout_s
    watchdog = None
    try:
        torch.set_num_threads(threads_per_rank(local_world_size))
        device = rank_device(config.training.device, local_rank)
        backend = select_backend(config.system.backend, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if backend == "nccl":
            # A timed-out nccl collective then aborts its communicator and ends the process, instead
            # of leaving the rank blocked on the GPU (the user's own setting wins).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if store is None and job.store is not None:
            # The agent's store outlives an attempt, and env:// would hand every attempt the same
            # keys: a restarted rank would read a dead rank's address and fail to connect. Each
            # attempt gets its own key space.
            store = dist.PrefixStore(f"attempt_{attempt}", job.store)
        joining = timedelta(seconds=max(timeout_s, SETUP_TIMEOUT_S))
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=joining)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=joining)
        try:
            watchdog = _hang_watchdog(job, attempt, rank, world_size, timeout_s)
            context = RankContext(rank, world_size, local_rank, local_world_size, backend, device, attempt)
            trainer = DDPTrainer(config, context, resume=resume, summary_json=summary_json, job=job, watchdog=watchdog)
            try:
                dist.set_timeout(timedelta(seconds=timeout_s))  # set up: from here on a collective waits T at most
                summary = trainer.run()
            finally:
                trainer.close()
            if watchdog is not None:
                watchdog.stop(finished=True)
            return summary
        finally:
            if watchdog is not None:
                watchdog.stop()
            dist.destroy_process_group()
    except EXPECTED_ERRORS as exc:
        job.record_fatal(str(exc))
        raise
