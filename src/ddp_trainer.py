"""Ring-allreduce data parallelism: DistributedDataParallel over torch.distributed, one process per rank.

    python run_ddp_training.py --world-size 2 --num-epochs 2                  # 2 local ranks, spawned
    python run_ddp_training.py --world-size 2 --allreduce ring                # explicit ring hook
    python run_ddp_training.py --world-size 2 --compression-enabled --compression-type topk --compression-ratio 0.01
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-id job1 run_ddp_training.py --num-epochs 2                     # 2 machines x 2 ranks

Launch: with ``--world-size N`` the launcher hosts a TCPStore on 127.0.0.1 (port 0: the OS picks a
free one, so there is no probe-then-bind race) and spawns N ranks with the spawn start method. When
the environment already has ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` (torchrun), nothing is
spawned: this process is one rank and joins through ``env://``; that is how a run spans machines.
gloo on CPU, nccl when the device is CUDA (``system.backend`` overrides). Each rank gets
``cores // local ranks`` intra-op threads so N ranks do not oversubscribe the machine.

Data: rank r of N reads ``make_shards(len(train), N, epoch, seed)[r]`` in batches of
``training.batch_size``. Step i of all ranks together then reads exactly the samples the baseline
reads at its step i with batch ``N * batch_size``. The loss on each rank is its per-sample loss sum
times ``N / (samples in the step across all ranks)``, so DDP's average over ranks is exactly the
large-batch mean even when the last step's batches are short or uneven. Every rank takes
``steps_per_epoch`` steps; a rank whose shard ran out takes an empty step (zero gradient, same
collectives) instead of using ``Join``: explicit, deterministic, and it keeps the comm hooks' step
counters in lock-step.

Gradient exchange: :mod:`src.comm_hooks` (built-in allreduce, ring hook, compressed hooks).
Evaluation: after every epoch each rank scores its slice ``r::N`` of the test split and the sums are
all-reduced, so every rank knows the accuracy. Checkpoints: rank 0 writes the common format
(``checkpoint_<epoch>.pt`` every ``checkpoint_interval`` epochs and ``ddp_final.pt``) with every
rank's hook state (residuals, step) gathered into ``extra["comm_hook"]``; ``--resume`` has rank 0
load the checkpoint and broadcast it, so the other machines need no copy of the file.

Outputs under ``system.log_dir``: ``summary.json`` (rank 0, whole run), ``ddp_rank_<r>.json`` (per
rank: samples, time, bytes), and per-rank TensorBoard + ``events.jsonl`` under ``rank_<r>/``; rank 0
also logs run-level events (eval, checkpoints) at the top level.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.checkpoint import (
    KEEP_CHECKPOINTS, CheckpointError, check_model_matches, final_checkpoint_path, load_latest_good, numbered_path,
    prune_checkpoints, save_checkpoint,
)
from src.comm_hooks import CommHook, bytes_accounting, comm_hook_from_config
from src.config import Config, validate_config
from src.data import DatasetUnavailableError, TensorDataset, make_shards, steps_per_epoch
from src.metrics import LOG_EVERY_STEPS, MetricsLogger, write_summary
from src.supervisor import LaunchError, stop_processes
from src.trainer import (
    checkpoint_of_run, evaluate, load_splits, model_from_config, optimizer_from_config, progress,
)

LOCAL_HOST = "127.0.0.1"
#: Errors a rank reports as one line (anything else is a bug and keeps its traceback).
EXPECTED_ERRORS = (DatasetUnavailableError, CheckpointError, ValueError)
_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


@dataclass(frozen=True)
class RankContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


# ----------------------------------------------------------------------------- launch checks


def torchrun_env(environ: dict[str, str] | None = None) -> dict[str, int] | None:
    """Rank layout from torchrun's environment, or ``None`` when not launched by torchrun."""
    environ = os.environ if environ is None else environ
    if not all(key in environ for key in _TORCHRUN_KEYS):
        return None
    world = int(environ["WORLD_SIZE"])
    return {
        "rank": int(environ["RANK"]),
        "world_size": world,
        "local_rank": int(environ.get("LOCAL_RANK", environ["RANK"])),
        "local_world_size": int(environ.get("LOCAL_WORLD_SIZE", world)),
    }


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda``/``auto`` put local rank k on GPU k; ``cuda:N`` is taken as given.

    Raises:
        ValueError: CUDA requested but not available.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"training.device: {name} requested but CUDA is not available")
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def select_backend(requested: str, device: torch.device) -> str:
    """``auto`` -> nccl on CUDA, gloo on CPU.

    Raises:
        ValueError: nccl without CUDA.
    """
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("system.backend: nccl requested but CUDA is not available (use gloo or auto)")
    if requested == "nccl" and device.type != "cuda":
        raise ValueError(f"system.backend: nccl needs a CUDA training.device, got {device}")
    return requested


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads for one of ``local_world_size`` ranks sharing this machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def check_launch(config: Config, *, local_world_size: int) -> None:
    """Reject configurations no rank could run, before anything is spawned.

    Raises:
        ValueError: one line naming the field (device, backend, world size against GPUs).
    """
    device = rank_device(config.training.device, 0)
    select_backend(config.system.backend, device)
    if device.type == "cuda" and local_world_size > 1:
        if config.training.device.startswith("cuda:"):
            raise ValueError(f"training.device: {config.training.device} would put all {local_world_size} local ranks on one GPU; use cuda or auto")
        if local_world_size > torch.cuda.device_count():
            raise ValueError(f"system.num_workers: {local_world_size} local ranks but only {torch.cuda.device_count()} CUDA devices")


def resolve_resume(config: Config, target: str | Path | None) -> str | None:
    """The checkpoint file ``--resume`` points at (newest good one in a folder), checked against the config.

    Raises:
        CheckpointError: nothing loadable.
        ValueError: the checkpoint holds a different model.
    """
    if target is None:
        return None
    path, checkpoint = load_latest_good(target)
    check_model_matches(path, checkpoint, config.training.model_architecture)
    return str(path)


# ----------------------------------------------------------------------------- the trainer


def _scaled_loss(logits: torch.Tensor, labels: torch.Tensor, world_size: int, step_samples: int) -> tuple[torch.Tensor, float, int]:
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
        context: this rank's place, backend and device.
        resume: checkpoint file to continue from (rank 0 reads it and broadcasts it).
        summary_json: run summary path (default ``<log_dir>/summary.json``), written by rank 0.
        comm_hook: factory ``(module) -> CommHook`` replacing the config's choice (benchmarks).
    """

    def __init__(
        self,
        config: Config,
        context: RankContext,
        *,
        resume: str | Path | None = None,
        summary_json: str | Path | None = None,
        comm_hook: Callable[[nn.Module], CommHook] | None = None,
    ):
        self.config = config
        self.ctx = context
        self.checkpoint_dir = Path(config.system.checkpoint_dir)
        self.log_dir = Path(config.system.log_dir)
        self.summary_json = Path(summary_json) if summary_json else self.log_dir / "summary.json"
        self.train_set, test_set = load_splits(config)
        rank, world = context.rank, context.world_size
        # Each rank scores its own slice of the test split; the sums are all-reduced.
        self.test_part = TensorDataset(test_set.info, test_set.images[rank::world].contiguous(), test_set.labels[rank::world].contiguous())
        self.model = model_from_config(config).to(context.device)
        self.optimizer = optimizer_from_config(config, self.model.parameters())
        self.start_epoch, self.step = 0, 0
        self.resumed_from: str | None = None
        saved_hook = self._restore(resume) if resume is not None else None
        device_ids = [context.device.index] if context.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        self.comm = comm_hook(self.model) if comm_hook is not None else comm_hook_from_config(config.system, self.model, seed=config.training.seed)
        self.comm.register(self.ddp)
        self.hook_note = self._restore_hook(saved_hook)

    # -- resume ---------------------------------------------------------------------------

    def _restore(self, target: str | Path) -> dict[str, Any] | None:
        message: list[Any] = [None]
        if self.ctx.rank == 0:
            try:
                path, checkpoint = load_latest_good(target)
                check_model_matches(path, checkpoint, self.config.training.model_architecture)
                message = [{"path": str(path), "checkpoint": checkpoint}]
            except EXPECTED_ERRORS as exc:
                message = [{"error": str(exc)}]
        # Broadcasting (not every rank reading the file) lets other machines resume without a copy.
        dist.broadcast_object_list(message, src=0, device=self._collective_device())
        received = message[0]
        if "error" in received:
            raise CheckpointError(received["error"])
        checkpoint = received["checkpoint"]
        self.model.load_state_dict(checkpoint["model_state_dict"])
        self.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        self.start_epoch, self.step = int(checkpoint["epoch"]), int(checkpoint["step"])
        self.resumed_from = received["path"]
        return checkpoint.get("extra", {}).get("comm_hook")

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
        loss, accuracy = evaluate(self.model, self.test_part, batch_size=self.config.training.eval_batch_size, device=self.ctx.device) if count else (0.0, 0.0)
        loss_sum, correct, total = self._all_reduce([loss * count, round(accuracy * count), count])
        return loss_sum / max(total, 1), correct / max(total, 1)

    def _checkpoint(self, path: Path, epoch: int) -> Path:
        states: list[Any] | None = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
        dist.gather_object(self.comm.state_dict(), states, dst=0)
        if self.ctx.rank == 0:
            checkpoint = checkpoint_of_run(
                self.config, self.model, self.optimizer, epoch=epoch, step=self.step,
                extra={"comm_hook": {"name": self.comm.name, "world_size": self.ctx.world_size, "ranks": states}},
            )
            save_checkpoint(path, checkpoint)
        return path

    # -- the loop -------------------------------------------------------------------------

    def _train_epoch(self, epoch: int, log: MetricsLogger) -> tuple[int, int]:
        """One epoch of this rank's shard; returns (samples, steps)."""
        t = self.config.training
        rank, world, device = self.ctx.rank, self.ctx.world_size, self.ctx.device
        num_train = len(self.train_set)
        per_step = t.batch_size * world
        num_steps = steps_per_epoch(num_train, world, t.batch_size)
        batches = list(make_shards(num_train, world, epoch, t.seed)[rank].batches(t.batch_size))
        batches += [[]] * (num_steps - len(batches))  # shard ran out: empty steps, same collectives
        stats = self.comm.stats
        samples = 0
        bar = progress(num_steps, f"epoch {epoch + 1}/{t.num_epochs}") if rank == 0 else _SilentBar()
        for index, indices in enumerate(batches):
            step_started = time.perf_counter()
            sent_before, hook_before = stats.total_sent, stats.hook_seconds
            dense_before, payload_before = stats.dense_bytes, stats.payload_bytes
            images, labels = self.train_set.batch(indices)
            images, labels = images.to(device), labels.to(device)
            self.optimizer.zero_grad(set_to_none=True)
            step_samples = min(per_step, num_train - index * per_step)  # all ranks together, this step
            loss, local_loss, correct = _scaled_loss(self.ddp(images), labels, world, step_samples)
            loss.backward()
            gradient_time = time.perf_counter() - step_started
            self.optimizer.step()
            self.comm.end_step()
            step_time = time.perf_counter() - step_started
            samples += len(labels)
            self.step += 1
            if self.step % LOG_EVERY_STEPS == 0 or index + 1 == num_steps:
                compression = {}
                if self.config.system.compression_enabled:
                    payload = stats.payload_bytes - payload_before
                    compression["compression_ratio"] = (stats.dense_bytes - dense_before) / payload if payload else None
                log.scalars("train", self.step, {
                    "loss": local_loss,
                    "accuracy": correct / max(len(labels), 1),
                    "throughput": len(labels) / step_time,
                    "gradient_time_s": gradient_time,  # forward + backward, the overlapped exchange included
                    "communication_time_s": stats.hook_seconds - hook_before,
                    "step_time_s": step_time,
                    "bytes_sent": stats.total_sent - sent_before,
                    "samples_processed": samples,
                    **compression,
                }, epoch=epoch)
            bar.update()
        bar.close()
        return samples, num_steps

    def run(self) -> dict[str, Any]:
        """Train, evaluate and checkpoint; returns the run summary (every rank returns the same one)."""
        t = self.config.training
        rank = self.ctx.rank
        started = time.perf_counter()
        train_time, samples, steps_run = 0.0, 0, 0
        rank_log = MetricsLogger(self.log_dir / f"rank_{rank}", rank=rank)
        run_log = MetricsLogger(self.log_dir) if rank == 0 else None
        try:
            rank_log.event("run_start", pid=os.getpid(), world_size=self.ctx.world_size, backend=self.ctx.backend,
                           device=str(self.ctx.device), threads=torch.get_num_threads(), comm_hook=self.comm.name)
            if run_log is not None:
                run_log.event("run_start", architecture="ddp", config=self.config.to_dict(), world_size=self.ctx.world_size,
                              backend=self.ctx.backend, comm_hook=self.comm.name, resumed_from=self.resumed_from, hook_note=self.hook_note)
                if self.hook_note:
                    print(f"warning: {self.hook_note}", flush=True)
            final_loss, final_accuracy = self._evaluate()
            self.ddp.train()
            for epoch in range(self.start_epoch, t.num_epochs):
                # Training time is the epoch loop's wall time (logging included; eval and checkpoints not).
                epoch_started = time.perf_counter()
                epoch_samples, epoch_steps = self._train_epoch(epoch, rank_log)
                train_time += time.perf_counter() - epoch_started
                samples, steps_run = samples + epoch_samples, steps_run + epoch_steps
                final_loss, final_accuracy = self._evaluate()
                if run_log is not None:
                    run_log.scalars("eval", self.step, {"test_loss": final_loss, "test_accuracy": final_accuracy}, epoch=epoch + 1)
                    print(f"epoch {epoch + 1}/{t.num_epochs}: test accuracy {final_accuracy * 100:.2f}%, test loss {final_loss:.4f}", flush=True)
                if (epoch + 1) % t.checkpoint_interval == 0 or epoch + 1 == t.num_epochs:
                    written = self._checkpoint(numbered_path(self.checkpoint_dir, epoch + 1), epoch + 1)
                    if run_log is not None:
                        prune_checkpoints(self.checkpoint_dir, KEEP_CHECKPOINTS)
                        run_log.event("checkpoint", path=str(written), epoch=epoch + 1, step=self.step)
            checkpoint_path = self._checkpoint(final_checkpoint_path(self.checkpoint_dir, "ddp"), max(t.num_epochs, self.start_epoch))
            common = {
                **self._description(),
                "final_accuracy": final_accuracy,
                "final_loss": final_loss,
                "checkpoint_path": str(checkpoint_path),
                "steps": self.step,
                "steps_this_run": steps_run,
            }
            rank_summary, summary = self._summaries(common, samples, train_time, steps_run, time.perf_counter() - started)
            rank_log.event("run_end", **{k: v for k, v in rank_summary.items() if k != "rank"})
            write_summary(self.log_dir / f"ddp_rank_{rank}.json", rank_summary)
            if run_log is not None:
                run_log.event("run_end", **summary)
                write_summary(self.summary_json, summary)
            self.rank_summary = rank_summary
            return summary
        finally:
            rank_log.close()
            if run_log is not None:
                run_log.close()

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
            "epochs": t.num_epochs,
        }

    def _summaries(self, common: dict[str, Any], samples: int, train_time: float, steps_run: int,
                   total_time: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this rank's summary, the run's summary); collective: every rank must call it."""
        stats, world = self.comm.stats, self.ctx.world_size
        totals = self._all_reduce([samples, stats.bytes_sent, stats.bytes_received, stats.estimated_bytes_sent, stats.estimated_bytes_received])
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
        }
        all_samples, measured, received, estimated, estimated_received = totals
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
        }
        return rank_summary, summary


# ----------------------------------------------------------------------------- process management


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

    Args:
        store: rendezvous store; ``None`` joins through ``env://`` (torchrun's MASTER_ADDR/PORT).

    Returns:
        The run summary.
    """
    torch.set_num_threads(threads_per_rank(local_world_size))
    device = rank_device(config.training.device, local_rank)
    backend = select_backend(config.system.backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
    try:
        context = RankContext(rank, world_size, local_rank, local_world_size, backend, device)
        return DDPTrainer(config, context, resume=resume, summary_json=summary_json).run()
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, port: int, config_data: dict, resume: str | None, summary_json: str | None, error_dir: str) -> None:
    # Die at once on SIGINT: a rank blocked inside a collective cannot run Python's handler, and
    # the parent (which also sees Ctrl-C, or dies and triggers the spawn death signal) stops us.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        store = dist.TCPStore(LOCAL_HOST, port, is_master=False)
        run_rank(validate_config(config_data), rank=rank, world_size=world_size, local_rank=rank,
                 local_world_size=world_size, store=store, resume=resume, summary_json=summary_json)
    except EXPECTED_ERRORS as exc:
        Path(error_dir, f"rank_{rank}.txt").write_text(str(exc))
        raise SystemExit(1) from None


def run_local(config: Config, *, resume: str | Path | None = None, summary_json: str | Path | None = None) -> dict[str, Any]:
    """Run ``system.num_workers`` ranks on this machine (spawned; one rank runs in-process).

    Returns:
        The run summary (rank 0's ``summary.json``).

    Raises:
        ValueError, CheckpointError: bad device/backend/world size or ``resume`` (before spawning).
        LaunchError: a rank stopped with an expected error (dataset missing ...).
        KeyboardInterrupt: interrupted; every rank has been stopped.
    """
    world = config.system.num_workers
    check_launch(config, local_world_size=world)
    resume_path = resolve_resume(config, resume)
    summary_path = Path(summary_json) if summary_json else Path(config.system.log_dir) / "summary.json"
    # The launcher hosts the rendezvous store on an OS-chosen port; ranks connect to it.
    store = dist.TCPStore(LOCAL_HOST, 0, is_master=True, wait_for_workers=False)
    if world == 1:
        return run_rank(config, rank=0, world_size=1, local_rank=0, local_world_size=1, store=store,
                        resume=resume_path, summary_json=summary_path)
    # We report why a rank stopped; torch's own "Terminating process ..." warnings only add noise.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    error_dir = tempfile.mkdtemp(prefix="ddp_errors_")
    context = mp.start_processes(
        _spawned_rank,
        args=(world, store.port, config.to_dict(), resume_path, str(summary_path), error_dir),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as exc:
        reasons = sorted({p.read_text() for p in Path(error_dir).glob("rank_*.txt")})
        if reasons:
            raise LaunchError("; ".join(reasons)) from None
        if exc.signal_name == "SIGINT":
            raise KeyboardInterrupt from None
        raise
    finally:
        stop_processes(context.processes, grace_s=10)
        shutil.rmtree(error_dir, ignore_errors=True)
    return json.loads(summary_path.read_text())


def run_torchrun(config: Config, *, world_size_flag: int | None = None, resume: str | Path | None = None,
                 summary_json: str | Path | None = None) -> dict[str, Any]:
    """Run this process as the rank torchrun assigned it.

    Raises:
        ValueError: ``--world-size`` disagrees with torchrun's WORLD_SIZE, or bad device/backend.
    """
    env = torchrun_env()
    if env is None:
        raise ValueError("not launched by torchrun: RANK, WORLD_SIZE and MASTER_ADDR must be set")
    if world_size_flag is not None and world_size_flag != env["world_size"]:
        raise ValueError(f"--world-size {world_size_flag} disagrees with torchrun's WORLD_SIZE={env['world_size']}")
    config = validate_config({**config.to_dict(), "system": {**config.to_dict()["system"], "num_workers": env["world_size"]}})
    check_launch(config, local_world_size=env["local_world_size"])
    return run_rank(config, **env, resume=resume, summary_json=summary_json)


def launch(config: Config, *, world_size_flag: int | None = None, resume: str | Path | None = None,
           summary_json: str | Path | None = None) -> dict[str, Any]:
    """torchrun environment -> be one rank; otherwise spawn ``system.num_workers`` local ranks."""
    if torchrun_env() is not None:
        return run_torchrun(config, world_size_flag=world_size_flag, resume=resume, summary_json=summary_json)
    return run_local(config, resume=resume, summary_json=summary_json)
