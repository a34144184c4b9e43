"""One rank of ring-allreduce data parallelism: DistributedDataParallel over torch.distributed.

Ranks are started by :mod:`src.ddp_launcher` (locally through torch's elastic agent, or by
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

Gradient exchange: :mod:`src.comm_hooks` (built-in allreduce, ring hook, compressed hooks).
Evaluation: after every epoch, and every ``training.eval_interval`` steps when set, each rank scores
its slice ``r::N`` of the test split and the sums are all-reduced, so every rank knows the accuracy;
the first evaluation at ``training.target_accuracy`` gives the time to target. Time is a
:class:`src.trainer.TrainingClock` (from the first training step; evaluation and checkpoints excluded).
Adaptive compression (``system.adaptive_compression``, top-k only, needs ``training.eval_interval``):
:mod:`src.ddp_control`: rank 0's controller decides at every evaluation from the eval loss and its
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
``slowdown`` / ``step_delay_s`` per rank) waits :class:`src.netem.ComputeDelay` after each backward.

Hung ranks: :func:`run_rank` starts a :class:`src.ddp_watchdog.HangWatchdog` (heartbeats in the
agent's store) and, once set up, limits every collective to ``system.collective_timeout_s``; a hung
peer ends the attempt, which the agent then restarts like one whose rank died.

Restarts: when the elastic agent restarts the group after a rank died (``TORCHELASTIC_RESTART_COUNT``
> 0), rank 0 resumes from the newest checkpoint this job wrote, which :class:`JobRecord` keeps in
the agent's store (so an older job's checkpoints in the same folder are never taken), and logs
``rank_restarted``. Faults (``system.inject_faults``, ``kill:rank=R@step=N``) fire in the first
attempt only. An expected error (missing dataset, unusable checkpoint, bad value) is recorded there
too, so later attempts stop at once instead of repeating a run that cannot succeed.

Exposed communication (:mod:`src.exposed_comm`): each step's wait at the end of the backward pass
for the gradient exchange, from the last gradient computed to ``backward()``'s return, as
``exposed_communication_s`` in the train scalars and the summaries (per rank; summed over ranks in
the run summary). Timeline spans (``--trace``): ``step`` > ``forward_backward`` (>
``exchange_wait``), ``optimizer_step``; ``evaluate``; ``checkpoint``; and each bucket's
``hook_exchange`` on the comm hook's thread (:mod:`src.comm_hooks`).

Outputs under ``system.log_dir``: ``summary.json`` (rank 0, whole run), ``ddp_rank_<r>.json`` (per
rank: samples, time, bytes), and per-rank TensorBoard + ``events.jsonl`` under ``rank_<r>/``; rank 0
also logs run-level events (eval, checkpoints, restarts) at the top level.
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

from src import netem, tracing
from src.checkpoint import (
    KEEP_CHECKPOINTS,
    CheckpointError,
    check_model_matches,
    final_checkpoint_path,
    load_latest_good,
    numbered_path,
    prune_checkpoints,
    save_checkpoint,
)
from src.comm_hooks import CommHook, comm_hook_from_config
from src.comm_stats import bytes_accounting
from src.config import Config, SetupError
from src.data import DatasetUnavailableError, TensorDataset, make_shards, steps_per_epoch
from src.ddp_control import RankControl, config_problem
from src.ddp_watchdog import HangWatchdog
from src.exposed_comm import BackwardWait
from src.faults import FaultInjector
from src.lr_schedule import set_scheduled_learning_rate
from src.metrics import LOG_EVERY_STEPS, MetricsLogger, TimeToTarget, write_summary
from src.supervisor import LaunchError, leave_process
from src.trackers import open_trackers
from src.trainer import (
    MixedPrecision,
    TrainingClock,
    checkpoint_of_run,
    eval_due,
    evaluate,
    load_splits,
    model_from_config,
    optimizer_from_config,
    progress,
    report_target,
    samples_due,
)

#: Errors a rank reports as one line (anything else is a bug and keeps its traceback). They cannot
#: succeed on a retry, so the first attempt's is recorded and later attempts stop at once.
EXPECTED_ERRORS = (DatasetUnavailableError, CheckpointError, SetupError, LaunchError)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    attempt: int = 0
    """How many times the elastic agent restarted the group before this attempt (0: the first)."""


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda``/``auto`` put local rank k on GPU k; ``cuda:N`` is taken as given.

    Raises:
        SetupError: CUDA requested but not available.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError(f"training.device: {name} requested but CUDA is not available")
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def select_backend(requested: str, device: torch.device) -> str:
    """``auto`` -> nccl on CUDA, gloo on CPU.

    Raises:
        SetupError: nccl without CUDA.
    """
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise SetupError("system.backend: nccl requested but CUDA is not available (use gloo or auto)")
    if requested == "nccl" and device.type != "cuda":
        raise SetupError(f"system.backend: nccl needs a CUDA training.device, got {device}")
    return requested


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads for one of ``local_world_size`` ranks sharing this machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def check_rank_setup(config: Config, world_size: int) -> None:
    """Raise :class:`SetupError` for settings no rank can train with (checked before launch and in each rank).

    * ``training.amp: fp16`` with compression: the GradScaler's loss scale changes during the run,
      so error feedback's residuals would mix gradients of different scales, and an overflowed
      step's infinite gradients cannot be compressed. bf16 needs no scaler.
    * ``emulation``: ranks emulate slower compute (``slowdown``, ``step_delay_s``); links are
      emulated for parameter-server runs only.
    """
    system = config.system
    if config.training.amp == "fp16" and system.compression_enabled:
        raise SetupError(
            "training.amp: fp16 scales the gradients by a factor that changes during the run, which error "
            "feedback's residuals cannot follow; with system.compression_enabled use bf16 (no loss scaling)"
        )
    netem.check_workers(config.emulation, world_size)
    for rank in range(world_size):
        conditions = netem.conditions_for(config.emulation, rank)
        if conditions.uplink is not None or conditions.downlink is not None:
            raise SetupError(
                "emulation: DDP ranks emulate slower compute (slowdown, step_delay_s); uplink/downlink "
                "bandwidth and latency are emulated for parameter-server runs only"
            )


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
                f"--resume {path}: taken {epoch_step} steps into epoch {int(checkpoint['epoch']) + 1} by {saved[0]} ranks "
                f"x batch {saved[1]}; this run has {here[0]} x {here[1]}, which would read other samples: resume it "
                f"with the same ranks and batch size, or from an epoch-end checkpoint"
            )


class JobRecord:
    """What every attempt of one elastic job shares: the newest checkpoint it wrote, and a fatal error.

    The elastic agent (torchrun, or :mod:`src.ddp_launcher`) hosts one TCPStore for the whole job
    and hands its address to every attempt as ``MASTER_ADDR``/``MASTER_PORT`` (with
    ``TORCHELASTIC_USE_AGENT_STORE=True``). Keys written there outlive a failed attempt, and a new
    job gets a new store, so a restarted attempt finds this job's checkpoint and never an older
    job's left in the same folder. Without an agent store (ranks started some other way, or store
    sharing switched off) nothing is recorded and a restart starts over from ``--resume``.
    """

    _PREFIX = "dts_ddp/"
    _NEWEST_CHECKPOINT = "newest_checkpoint"
    _FATAL = "fatal_error"

    def __init__(self, store: dist.Store | None = None):
        self.store = store

    @classmethod
    def from_environment(cls) -> "JobRecord":
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return cls(None)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
        )
        return cls(store)

    def _get(self, key: str) -> str | None:
        if self.store is None or not self.store.check([self._PREFIX + key]):
            return None
        return self.store.get(self._PREFIX + key).decode()

    def _set(self, key: str, value: str) -> None:
        if self.store is not None:
            self.store.set(self._PREFIX + key, value)
            # A store's set does not wait for the server; a read on the same connection does, so
            # the value is in the store (for the next attempt) before this returns.
            self.store.get(self._PREFIX + key)

    def newest_checkpoint(self) -> str | None:
        return self._get(self._NEWEST_CHECKPOINT)

    def checkpoint_written(self, path: str | Path) -> None:
        self._set(self._NEWEST_CHECKPOINT, str(path))

    def fatal_error(self) -> str | None:
        return self._get(self._FATAL)

    def record_fatal(self, message: str) -> None:
        self._set(self._FATAL, message)


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
        watchdog: this rank's hung-peer watchdog (:mod:`src.ddp_watchdog`), whose ``rank_hung``
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
        self.checkpoint_dir = Path(config.system.checkpoint_dir)
        self.log_dir = Path(config.system.log_dir)
        self.summary_json = Path(summary_json) if summary_json else self.log_dir / "summary.json"
        self.train_set, test_set = load_splits(config)
        rank, world = context.rank, context.world_size
        # Each rank scores its own slice of the test split; the sums are all-reduced.
        self.test_part = TensorDataset(
            test_set.info, test_set.images[rank::world].contiguous(), test_set.labels[rank::world].contiguous()
        )
        self.model = model_from_config(config).to(context.device)
        self.optimizer = optimizer_from_config(config, self.model.parameters())
        self.amp = MixedPrecision(config.training.amp, context.device)
        # An emulated straggler (emulation.workers[rank]): each step's compute stretched, as a PS worker's.
        self.compute_delay = netem.ComputeDelay(
            netem.conditions_for(config.emulation, rank), netem.worker_seed(config.training.seed, rank)
        )
        self.start_epoch, self.start_index, self.step, self.steps_run = 0, 0, 0, 0
        self.resumed_from: str | None = None
        self._saved_control: dict[str, Any] | None = None
        self.faults = FaultInjector(config.system.inject_faults, "rank", rank, enabled=context.attempt == 0)
        saved_hook = self._restore(resume) if resume is not None or context.attempt > 0 else None
        device_ids = [context.device.index] if context.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        self.comm = (
            comm_hook(self.model)
            if comm_hook is not None
            else comm_hook_from_config(config.system, self.model, seed=config.training.seed)
        )
        self.comm.register(self.ddp)
        self.hook_note = self._restore_hook(saved_hook)
        # Adaptive compression (src/ddp_control.py): rank 0's controller decides at evaluations, every
        # rank sets its hook's top-k ratio from the same step.
        self.control: RankControl | None = None
        if config.system.adaptive_compression:
            if self.comm.topk_ratio is None:
                raise SetupError(
                    f"system.adaptive_compression sets top-k's Active Fraction: the comm hook {self.comm.name!r} "
                    f"does not compress with top-k"
                )
            self.control = RankControl.for_run(
                config.system, rank, compression_ratio=self.comm.topk_ratio, saved=self._saved_control
            )
            if self.control.compression_ratio != self.comm.topk_ratio:  # resumed: the ratio in effect at the checkpoint
                self.comm.set_topk_ratio(self.control.compression_ratio)
        # DDP re-buckets after a process's first backward pass; a silent one now makes every
        # training step see the final buckets (the compression units; see src.comm_hooks).
        self.comm.settle_buckets(self.ddp, self.train_set.images[:1].to(context.device))
        self.backward_wait = BackwardWait(self.model)  # exposed communication (src/exposed_comm.py)

    def close(self) -> None:
        """Stop the comm hook's exchange thread and let go of DDP (before the group is destroyed).

        (torch keeps gloo's own threads alive even so; see :func:`leave_rank_process`.)
        """
        closer = getattr(self.comm, "close", None)
        if callable(closer):
            closer()
        self.backward_wait.close()
        self.ddp = self.comm = None
        gc.collect()

    # -- resume ---------------------------------------------------------------------------

    def _resume_target(self, requested: str | Path | None) -> str | Path | None:
        """Rank 0: a restarted attempt continues from this job's newest checkpoint, else from ``requested``."""
        if self.ctx.attempt > 0:
            return self.job.newest_checkpoint() or requested
        return requested

    def _load_for_resume(self, target: str | Path) -> dict[str, Any]:
        """Rank 0: load ``target`` (newest good checkpoint) and check this run can continue it."""
        path, checkpoint = load_latest_good(target)
        check_resumable(path, checkpoint, self.config, self.ctx.world_size)
        return {"path": str(path), "checkpoint": checkpoint}

    def _restore(self, requested: str | Path | None) -> dict[str, Any] | None:
        message: list[Any] = [None]
        if self.ctx.rank == 0:
            target = self._resume_target(requested)
            try:
                message = [self._load_for_resume(target) if target is not None else {"fresh": True}]
            except EXPECTED_ERRORS as exc:
                message = [{"error": str(exc)}]
        # Broadcasting (not every rank reading the file) lets other machines resume without a copy.
        dist.broadcast_object_list(message, src=0, device=self._collective_device())
        received = message[0]
        if "error" in received:
            raise CheckpointError(received["error"])
        if "fresh" in received:
            return None
        checkpoint = received["checkpoint"]
        self.model.load_state_dict(checkpoint["model_state_dict"])
        self.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        self.start_epoch, self.step = int(checkpoint["epoch"]), int(checkpoint["step"])
        self.start_index = int(checkpoint["extra"].get("epoch_step", 0))
        self.resumed_from = received["path"]
        self._saved_control = checkpoint["extra"].get("controller")
        self.amp.load_state_dict(checkpoint["extra"].get("grad_scaler"))
        return checkpoint["extra"].get("comm_hook")

    def _restore_hook(self, saved: dict[str, Any] | None) -> str | None:
        """Load this rank's hook state; returns a note when it could not be used (the run goes on)."""
        if self.resumed_from is None:
            return None
        self.comm.set_step(self.step)
        if not self.comm.state_dict():
            return None  # a stateless exchange (allreduce, ring): nothing to restore
        if not saved:
            return "checkpoint has no comm hook state; the hook starts fresh"
        if saved.get("name") != self.comm.name:
            return f"checkpoint's comm hook is {saved.get('name')!r}, this run uses {self.comm.name!r}; the hook starts fresh"
        if saved.get("world_size") != self.ctx.world_size:
            return f"checkpoint has hook state for {saved.get('world_size')} ranks, this run has {self.ctx.world_size}; the hook starts fresh"
        try:
            self.comm.load_state_dict(saved["ranks"][self.ctx.rank])
        except ValueError as exc:  # e.g. error feedback switched off since the checkpoint
            return f"{exc}; the hook starts fresh"
        return None

    # -- collectives helpers --------------------------------------------------------------

    def _collective_device(self) -> torch.device:
        return self.ctx.device if self.ctx.backend == "nccl" else torch.device("cpu")

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def _evaluate(self) -> tuple[float, float]:
        count = len(self.test_part)
        loss, accuracy = (
            evaluate(
                self.model, self.test_part, batch_size=self.config.training.eval_batch_size, device=self.ctx.device
            )
            if count
            else (0.0, 0.0)
        )
        loss_sum, correct, total = self._all_reduce([loss * count, round(accuracy * count), count])
        return loss_sum / max(total, 1), correct / max(total, 1)

    def _evaluate_and_log(
        self, run_log: MetricsLogger | None, epoch: int, clock: TrainingClock, target: TimeToTarget
    ) -> tuple[float, float]:
        """Evaluate (collective) with the clock stopped; rank 0 logs it; every rank feeds ``target``."""
        with clock.paused(), tracing.span("evaluate", step=self.step):
            loss, accuracy = self._evaluate()
            (seconds,) = self._all_reduce([clock.seconds], op=dist.ReduceOp.MAX)  # the slowest rank's clock
            event = None
            if run_log is not None:
                event = run_log.scalars("eval", self.step, {"test_loss": loss, "test_accuracy": accuracy}, epoch=epoch)
                report_target(target, accuracy, seconds, self.step)
            else:
                target.observe(accuracy, seconds, self.step)
            if self.control is not None:
                decision = self.control.decide(event, self._collective_device())  # collective: rank 0's, broadcast
                if decision is not None and run_log is not None:
                    run_log.event("controller", **{k: v for k, v in decision.items() if k != "kind"})
        return loss, accuracy

    def _checkpoint(self, path: Path, *, epoch: int, epoch_step: int = 0) -> Path:
        """Write a checkpoint (collective: every rank's hook state is gathered to rank 0)."""
        with tracing.span("checkpoint", step=self.step):
            states: list[Any] | None = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
            dist.gather_object(self.comm.state_dict(), states, dst=0)
            if self.ctx.rank == 0:
                checkpoint = checkpoint_of_run(
                    self.config,
                    self.model,
                    self.optimizer,
                    epoch=epoch,
                    step=self.step,
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

    def _numbered_checkpoint(
        self, run_log: MetricsLogger | None, clock: TrainingClock, *, epoch: int, epoch_step: int
    ) -> None:
        with clock.paused():
            written = self._checkpoint(
                numbered_path(self.checkpoint_dir, self.step), epoch=epoch, epoch_step=epoch_step
            )
            if run_log is not None:
                prune_checkpoints(self.checkpoint_dir, KEEP_CHECKPOINTS)
                run_log.event("checkpoint", path=str(written), epoch=epoch, epoch_step=epoch_step, step=self.step)

    def _step_checkpoint_due(self) -> bool:
        interval = self.config.training.checkpoint_interval_steps
        return interval > 0 and self.step % interval == 0

    # -- the loop -------------------------------------------------------------------------

    def _train_epoch(
        self,
        epoch: int,
        first_index: int,
        rank_log: MetricsLogger,
        run_log: MetricsLogger | None,
        clock: TrainingClock,
        target: TimeToTarget,
    ) -> tuple[int, int]:
        """Epoch ``epoch`` of this rank's shard from batch ``first_index`` on; returns (samples, steps)."""
        t = self.config.training
        rank, world, device = self.ctx.rank, self.ctx.world_size, self.ctx.device
        num_train = len(self.train_set)
        per_step = t.batch_size * world
        num_steps = steps_per_epoch(num_train, world, t.batch_size)
        batches = list(make_shards(num_train, world, epoch, t.seed)[rank].batches(t.batch_size))
        batches += [[]] * (num_steps - len(batches))  # shard ran out: empty steps, same collectives
        stats = self.comm.stats
        samples = 0
        bar = progress(num_steps - first_index, f"epoch {epoch + 1}/{t.num_epochs}") if rank == 0 else _SilentBar()
        for index in range(first_index, num_steps):
            indices = batches[index]
            if self.control is not None:
                self._follow_control(rank_log)
            step_started = time.perf_counter()
            sent_before, hook_before = stats.total_sent, stats.hook_seconds
            dense_before, payload_before = stats.dense_bytes, stats.payload_bytes
            images, labels = self.train_set.batch(indices)
            images, labels = images.to(device), labels.to(device)
            self.optimizer.zero_grad(set_to_none=True)
            step_samples = min(per_step, num_train - index * per_step)  # all ranks together, this step
            with tracing.span("forward_backward", step=self.step + 1):
                with self.amp.autocast():
                    loss, local_loss, correct = _scaled_loss(self.ddp(images), labels, world, step_samples)
                self.backward_wait.backward_started()
                self.amp.backward(loss)
                exposed = self.backward_wait.backward_ended(time.perf_counter())  # DDP's wait for the exchange
                if self.compute_delay.active:
                    self.compute_delay.after_step(time.perf_counter() - step_started)
            gradient_time = time.perf_counter() - step_started
            set_scheduled_learning_rate(self.optimizer, t, self.step)  # training.lr_schedule, the same on every rank
            with tracing.span("optimizer_step", step=self.step + 1):
                self.amp.step(self.optimizer)  # fp16: skipped on every rank alike (the same averaged gradients)
            self.comm.end_step()
            step_time = time.perf_counter() - step_started
            if self.control is not None:
                self.control.step_done(step_time, stats.hook_seconds - hook_before)
            samples += len(labels)
            self.step += 1
            self.steps_run += 1
            tracing.record("step", step_started, time.perf_counter(), step=self.step)
            epoch_end = index + 1 == num_steps
            if self.step % LOG_EVERY_STEPS == 0 or epoch_end:
                compression = {}
                if self.config.system.compression_enabled:
                    payload = stats.payload_bytes - payload_before
                    compression["compression_ratio"] = (stats.dense_bytes - dense_before) / payload if payload else None
                rank_log.scalars(
                    "train",
                    self.step,
                    {
                        "loss": local_loss,
                        "accuracy": correct / max(len(labels), 1),
                        "throughput": len(labels) / step_time,
                        "gradient_time_s": gradient_time,  # forward + backward, the overlapped exchange included
                        "communication_time_s": stats.hook_seconds - hook_before,
                        "exposed_communication_s": exposed,
                        "step_time_s": step_time,
                        "bytes_sent": stats.total_sent - sent_before,
                        "samples_processed": samples,
                        **compression,
                    },
                    epoch=epoch,
                )
            if not epoch_end:  # the epoch's end has its own evaluation and checkpoint
                # all ranks together, from the epoch's start: the same count on every rank (and after a resume)
                done = epoch * num_train + min((index + 1) * per_step, num_train)
                if eval_due(self.step, t.eval_interval, epoch_end=False) or samples_due(
                    done - step_samples, done, t.eval_every_samples
                ):
                    self._evaluate_and_log(run_log, epoch, clock, target)
                if self._step_checkpoint_due():
                    self._numbered_checkpoint(run_log, clock, epoch=epoch, epoch_step=index + 1)
            bar.update()
            self.faults.reached(self.steps_run)  # a real SIGKILL, after the step and its checkpoint
        bar.close()
        return samples, num_steps - first_index

    def _follow_control(self, rank_log: MetricsLogger) -> None:
        """Before step ``self.step + 1``: switch the hook's top-k ratio if a decision applies from it (every rank alike)."""
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
        t = self.config.training
        rank = self.ctx.rank
        started = time.perf_counter()
        clock, target = TrainingClock(), TimeToTarget(t.target_accuracy)
        samples, steps_run = 0, 0
        tensorboard = "tensorboard" in self.config.metrics.trackers
        rank_log = MetricsLogger(self.log_dir / f"rank_{rank}", tensorboard=tensorboard, rank=rank)
        # Rank 0 owns the run summary, so it alone logs to the trackers; a restarted group continues their runs.
        run_log = (
            MetricsLogger(
                self.log_dir,
                tensorboard=tensorboard,
                sinks=open_trackers(self.config, self.log_dir, resume=self.ctx.attempt > 0),
            )
            if rank == 0
            else None
        )
        # rank_hung events (src.ddp_watchdog) go into this rank's log, and rank 0's into the run's too
        reporters = [log.event for log in (rank_log, run_log) if log is not None] if self.watchdog is not None else []
        for reporter in reporters:
            self.watchdog.report_to(reporter)
        try:
            rank_log.event(
                "run_start",
                pid=os.getpid(),
                world_size=self.ctx.world_size,
                backend=self.ctx.backend,
                device=str(self.ctx.device),
                threads=torch.get_num_threads(),
                comm_hook=self.comm.name,
                attempt=self.ctx.attempt,
            )
            if run_log is not None:
                run_log.event(
                    "run_start",
                    architecture="ddp",
                    config=self.config.to_dict(),
                    world_size=self.ctx.world_size,
                    backend=self.ctx.backend,
                    comm_hook=self.comm.name,
                    resumed_from=self.resumed_from,
                    hook_note=self.hook_note,
                    attempt=self.ctx.attempt,
                )
                if self.hook_note:
                    logger.warning("%s", self.hook_note)
            if self.ctx.attempt > 0:
                self._log_restart(rank_log, run_log)
            final_loss, final_accuracy = self._evaluate()
            self.ddp.train()
            for epoch in range(self.start_epoch, t.num_epochs):
                first_index = self.start_index if epoch == self.start_epoch else 0
                with clock.running():
                    epoch_samples, epoch_steps = self._train_epoch(epoch, first_index, rank_log, run_log, clock, target)
                samples, steps_run = samples + epoch_samples, steps_run + epoch_steps
                final_loss, final_accuracy = self._evaluate_and_log(run_log, epoch + 1, clock, target)
                if run_log is not None:
                    logger.info(
                        "epoch %d/%d: test accuracy %.2f%%, test loss %.4f",
                        epoch + 1,
                        t.num_epochs,
                        final_accuracy * 100,
                        final_loss,
                    )
                if (epoch + 1) % t.checkpoint_interval == 0 or epoch + 1 == t.num_epochs or self._step_checkpoint_due():
                    self._numbered_checkpoint(run_log, clock, epoch=epoch + 1, epoch_step=0)
            checkpoint_path = self._checkpoint(
                final_checkpoint_path(self.checkpoint_dir, "ddp"), epoch=max(t.num_epochs, self.start_epoch)
            )
            common = {
                **self._description(),
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
            rank_summary, summary = self._summaries(
                common, samples, clock.seconds, steps_run, time.perf_counter() - started
            )
            rank_log.event("run_end", **{k: v for k, v in rank_summary.items() if k != "rank"})
            write_summary(self.log_dir / f"ddp_rank_{rank}.json", rank_summary)
            if run_log is not None:
                run_log.event("run_end", **summary)
                write_summary(self.summary_json, summary)
                run_log.finish(summary, artifacts=[self.summary_json, checkpoint_path])
            self.rank_summary = rank_summary
            return summary
        except RuntimeError:
            # A collective timed out (or failed) before the watchdog's own verdict: a silent peer is
            # the hung one (logged here; this process then ends, see src.ddp_watchdog), else re-raise.
            if self.watchdog is not None:
                self.watchdog.collective_failed()
            raise
        finally:
            for reporter in reporters:
                self.watchdog.forget(reporter)
            rank_log.close()
            if run_log is not None:
                run_log.close()

    def _log_restart(self, rank_log: MetricsLogger, run_log: MetricsLogger | None) -> None:
        """The ``rank_restarted`` event: which attempt this is and where it continues from."""
        fields = {
            "attempt": self.ctx.attempt,
            "max_restarts": _int_env("TORCHELASTIC_MAX_RESTARTS"),
            "resumed_from": self.resumed_from,
            "step": self.step,
            "epoch": self.start_epoch,
            "epoch_step": self.start_index,
        }
        rank_log.event("rank_restarted", **fields)
        if run_log is not None:
            run_log.event("rank_restarted", **fields)
            where = (
                f"from {self.resumed_from} (step {self.step})"
                if self.resumed_from
                else "from the start (no checkpoint yet)"
            )
            budget = f"/{fields['max_restarts']}" if fields["max_restarts"] is not None else ""
            logger.info("restart %d%s: the group continues %s", self.ctx.attempt, budget, where)

    def _description(self) -> dict[str, Any]:
        """What ran: the fields every summary of this run shares."""
        t, system = self.config.training, self.config.system
        compression = system.compression_type if system.compression_enabled else "none"
        return {
            "architecture": "ddp",
            "dataset": t.dataset,
            "num_workers": self.ctx.world_size,
            "world_size": self.ctx.world_size,
            "backend": self.ctx.backend,
            "allreduce": system.allreduce,
            "comm_hook": self.comm.name,
            "compression": compression,
            "compression_ratio": system.compression_ratio if compression == "topk" else None,
            "quantization_bits": system.quantization_bits if compression == "quantization" else None,
            "error_feedback": bool(system.compression_enabled and system.error_feedback),
            "compression_value_dtype": system.compression_value_dtype if compression == "topk" else None,
            "epochs": t.num_epochs,
            "collective_timeout_s": system.collective_timeout_s,
        }

    def _summaries(
        self, common: dict[str, Any], samples: int, train_time: float, steps_run: int, total_time: float
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this rank's summary, the run's summary); collective: every rank must call it."""
        stats, world = self.comm.stats, self.ctx.world_size
        totals = self._all_reduce(
            [
                samples,
                stats.bytes_sent,
                stats.bytes_received,
                stats.estimated_bytes_sent,
                stats.estimated_bytes_received,
                self.backward_wait.total_s,
            ]
        )
        (slowest,) = self._all_reduce([train_time], op=dist.ReduceOp.MAX)
        rank_summary = {
            **common,
            "rank": self.ctx.rank,
            "total_time_s": total_time,
            "train_time_s": train_time,
            "throughput_samples_per_s": samples / train_time if train_time > 0 else 0.0,
            "samples_processed": samples,
            "bytes_sent": stats.total_sent,
            "bytes_received": stats.total_received,
            "bytes_sent_measured": stats.bytes_sent,
            "bytes_sent_estimated": stats.estimated_bytes_sent,
            "bytes_accounting": stats.accounting(),
            "bytes_sent_per_step": stats.total_sent / steps_run if steps_run else 0.0,
            "communication_time_s": stats.hook_seconds,
            "exposed_communication_s": self.backward_wait.total_s,
            "emulated_delay_s": self.compute_delay.delay_s,
            **self.amp.summary(),
        }
        all_samples, measured, received, estimated, estimated_received, exposed = totals
        summary = {
            **common,
            "total_time_s": total_time,
            "train_time_s": slowest,
            "throughput_samples_per_s": all_samples / slowest if slowest > 0 else 0.0,
            "samples_processed": int(all_samples),
            "bytes_sent": int(measured + estimated),  # all ranks together
            "bytes_received": int(received + estimated_received),
            "bytes_sent_measured": int(measured),
            "bytes_sent_estimated": int(estimated),
            "bytes_accounting": bytes_accounting(measured, estimated),
            "bytes_sent_per_rank_per_step": (measured + estimated) / (world * steps_run) if steps_run else 0.0,
            "exposed_communication_s": exposed,  # all ranks together (src/exposed_comm.py)
            **self.amp.summary(),  # every rank skips the same steps
        }
        return rank_summary, summary


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


# ----------------------------------------------------------------------------- one rank's life


def leave_rank_process(code: int) -> NoReturn:
    """End a rank process with ``code`` once its outputs are flushed, skipping interpreter shutdown.

    Once DDP has run, torch keeps the gloo process group, and its threads, alive after
    ``destroy_process_group`` (measured: its three gloo threads are still there after DDP is
    deleted and the garbage collected); see :func:`src.supervisor.leave_process`.
    """
    leave_process(code)


SETUP_TIMEOUT_S = 300.0
"""What a collective may wait while the group joins and sets up (loading data, restoring a checkpoint,
DDP's first broadcast), when ranks start unevenly; training collectives wait ``system.collective_timeout_s``."""


def _hang_watchdog(job: JobRecord, attempt: int, rank: int, world_size: int, timeout_s: float) -> HangWatchdog | None:
    """This rank's watchdog over its peers' heartbeats, on its own connection to the agent's store (none without one)."""
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
    an elastic agent a :class:`~src.ddp_watchdog.HangWatchdog` watches the peers' heartbeats, and
    training collectives wait at most ``system.collective_timeout_s``: a hung rank fails the attempt
    (see :mod:`src.ddp_watchdog`).

    Args:
        store: rendezvous store; ``None`` joins through the elastic agent's store (``MASTER_ADDR``/
            ``MASTER_PORT``), with its keys kept apart per restart attempt.

    Returns:
        The run summary.

    Raises:
        LaunchError: an earlier attempt of this job stopped on an expected error (it would again).
    """
    attempt = _int_env("TORCHELASTIC_RESTART_COUNT") or 0
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
