"""A parameter-server worker's compute on the batches the server hands it, whoever keeps the time.

:class:`WorkerCompute` computes the gradient of the handed batches into the model's ``.grad``: ``system.local_steps``
= H > 1 takes H local SGD steps, one per batch, at the server's rate for the version, and pushes the sum of their
gradients; under ``training.amp`` in autocast, fp16 unscaled by a GradScaler and an overflowed batch computed again at
the lowered scale (:meth:`WorkerCompute._forward_backward`). It also fires the faults injected at a step and keeps
``system.gradient_ledger`` (every gradient computed, before error feedback).

Its drivers are the process worker (:mod:`src.worker`, its own model) and the simulated worker
(:mod:`src.virtual.worker`): many simulated workers share one compute model, each keeping only its parameter replica
(what the server last sent it), which is copied into the shared model before its gradient is computed. Either way the
same code computes the same gradients from the same replies; the protocol around it is the step machine's
(:mod:`src.ps.worker.machine`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.common.faults import FaultInjector, FaultSpec
from src.config import Config, SetupError
from src.metrics import MetricsLogger
from src.ps.shards.placement import Placement
from src.ps.worker.codec import PushCodec
from src.ps.worker.loading import served_tensors
from src.ps.worker.machine import StepMachine
from src.ps.worker.membership import Membership
from src.trainer import MixedPrecision, forward_backward
from src.training.lr_schedule import scheduled_learning_rate
from src.transport.wire import tensor_view

MAX_OVERFLOW_RETRIES = 32
"""fp16: computations of one batch before its gradient counts as not finite at any scale (GradScaler halves
the scale at each overflow: 2**16 down to 2**-16)."""


def check_layout(
    worker_id: int, config: Config, model: nn.Module, registration: pb.RegisterReply, placement: Placement | None = None
) -> None:
    """Raise :class:`SetupError` unless the local model's parameters are the server's (names and shapes); with a
    sharded server's ``placement``, unless shard 0's slices of it are the ones shard 0 serves."""
    if placement is None:
        local_layout = [(n, list(p.shape)) for n, p in served_tensors(model)[0]]
    else:
        local_layout = [(piece.key, [piece.numel]) for piece in placement.on_shard(0)]
    server_layout = [(s.name, list(s.shape)) for s in registration.parameter_specs]
    if local_layout != server_layout:
        raise SetupError(
            f"worker {worker_id}: the local {config.training.model_architecture} does not match the server's parameters"
        )


def worker_log(config: Config, worker_id: int, *, tensorboard: bool, **clock: Any) -> MetricsLogger:
    """Worker ``worker_id``'s event log, ``<log_dir>/worker_<k>`` (TensorBoard scalars beside it when
    ``tensorboard`` and the run's trackers name it; ``clock``: a virtual run's)."""
    tensorboard = tensorboard and "tensorboard" in config.metrics.trackers
    path = Path(config.system.log_dir) / f"worker_{worker_id}"
    return MetricsLogger(path, tensorboard=tensorboard, role="worker", worker=worker_id, **clock)


class WorkerCompute:
    """One worker's gradients (see the module docstring).

    Args:
        config: the run's config.
        worker_id: the worker's id.
        model: the module gradients are computed in (the worker's own, or one shared by simulated workers).
        train_set: the training split (``batch(indices)``).
        device: where ``model`` lives.
        log: this worker's event log.
        replica: ``(parameters, buffers)`` the replies are loaded into when they are not ``model``'s own (a simulated
            worker's replica); default: ``model``'s trainable parameters and float buffers.
        faults: this incarnation's injected faults (:meth:`reach_step` fires them).
        fire_fault: what a due fault does (default: signal this process).
    """

    def __init__(
        self,
        config: Config,
        worker_id: int,
        *,
        model: nn.Module,
        train_set: Any,
        device: torch.device,
        log: MetricsLogger,
        replica: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
        faults: FaultInjector | None = None,
        fire_fault: Callable[[FaultSpec], None] | None = None,
    ):
        self.worker_id = worker_id
        self.model = model
        named_params, named_buffers = served_tensors(model)
        self.names = [n for n, _ in named_params]
        self.buffer_names = [n for n, _ in named_buffers]
        self.model_params = [p for _, p in named_params]
        self.model_buffers = [b for _, b in named_buffers]
        self.params, self.buffers = replica if replica is not None else (self.model_params, self.model_buffers)
        self.train_set = train_set
        self.device = device
        self.log = log
        self.training = config.training
        self.amp = MixedPrecision(config.training.amp, device)  # training.amp: autocast; fp16 with its own GradScaler
        self.faults = faults or FaultInjector((), "worker", worker_id)
        self.fire_fault = fire_fault
        # system.gradient_ledger: the sum of every gradient computed (before error feedback), float64
        ledger = config.system.gradient_ledger
        self.ledger = [torch.zeros(p.shape, dtype=torch.float64) for p in self.model_params] if ledger else None

    def gradients(self, batches: Sequence[pb.Batch]) -> list[tuple[str, torch.Tensor]]:
        """Each trainable tensor's gradient by name, as the step computed it (zeros for none, and for a flush: no
        batches, only what error feedback carries goes)."""
        return [(n, self.gradient(i, batches)) for i, n in enumerate(self.names)]

    def gradient(self, index: int, batches: Sequence[pb.Batch]) -> torch.Tensor:
        """Tensor ``index``'s gradient (zeros when it got none, or for a flush)."""
        param = self.model_params[index]
        return torch.zeros_like(param) if not batches or param.grad is None else param.grad

    def buffers_to_send(self, batches: Sequence[pb.Batch]) -> list[memoryview]:
        """The model's float buffers after the step (none for a flush)."""
        return [tensor_view(b) for b in self.model_buffers] if batches else []

    def compute(self, batches: Sequence[pb.Batch], version: int, step: int) -> tuple[float, int, int]:
        """Gradients of the handed batches into the model's ``.grad`` (summed; local SGD steps between them, at the
        server's rate for ``version``); ``step``: the worker's step it is.

        Returns the mean loss, the correct count and the samples. The parameters the step started from are what the
        worker holds afterwards (local steps move only the compute model).
        """
        if not batches:
            return 0.0, 0, 0
        shared = self.params is not self.model_params
        if shared:  # a simulated worker: its replica into the shared compute model
            with torch.no_grad():
                for param, value in zip(self.model_params, self.params):
                    param.copy_(value)
                for buffer, value in zip(self.model_buffers, self.buffers):
                    buffer.copy_(value)
        started_from = [p.detach().clone() for p in self.model_params] if len(batches) > 1 and not shared else None
        summed: list[torch.Tensor] | None = None
        local_lr = scheduled_learning_rate(self.training.lr_schedule, self.training.learning_rate, version)
        total_loss, total_correct, total_samples = 0.0, 0, 0
        for index, batch in enumerate(batches):
            images, labels = self.train_set.batch(list(batch.indices))
            loss, correct = self._forward_backward(batch, images.to(self.device), labels.to(self.device), step)
            total_loss += loss * len(batch.indices)
            total_correct += correct
            total_samples += len(batch.indices)
            if len(batches) == 1:
                break
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model_params]
            summed = [g.clone() for g in grads] if summed is None else [s.add_(g) for s, g in zip(summed, grads)]
            if index + 1 < len(batches):
                with torch.no_grad():
                    for p, g in zip(self.model_params, grads):
                        p.add_(g, alpha=-local_lr)  # a local plain-SGD step, at the server's rate for this version
        if summed is not None:
            for p, s in zip(self.model_params, summed):
                p.grad = s
        if started_from is not None:  # the worker holds what the server sent (a downlink delta adds to it)
            with torch.no_grad():
                for p, value in zip(self.model_params, started_from):
                    p.copy_(value)
        if self.ledger is not None:
            for total, p in zip(self.ledger, self.model_params):
                if p.grad is not None:
                    total.add_(p.grad.to(torch.float64))
        return total_loss / max(total_samples, 1), total_correct, total_samples

    def _forward_backward(
        self, batch: pb.Batch, images: torch.Tensor, labels: torch.Tensor, step: int
    ) -> tuple[float, int]:
        """One batch's true gradient into ``.grad`` (``training.amp``: autocast; fp16 unscaled).

        An fp16 gradient that overflowed is not pushed, as GradScaler skips such a step; but the batch is this
        worker's to cover (the server plans every sample into exactly one update), so it is computed again at the
        scale GradScaler lowered, until it is finite: the simplest way that both keeps every sample's gradient and
        never sends an inf. (The batch-norm statistics of the overflowed pass are undone.)
        """
        buffers = [b.clone() for b in self.model_buffers] if self.amp.scaler is not None else None
        for _ in range(MAX_OVERFLOW_RETRIES):
            self.model.zero_grad(set_to_none=True)
            loss, correct = forward_backward(self.model, images, labels, self.amp)
            if self.amp.unscale(self.model_params):
                return loss, correct
            scale = self.amp.scaler.get_scale()
            self.log.event("amp_overflow", step=step, batch_id=batch.batch_id, loss_scale=scale)
            with torch.no_grad():
                for buffer, saved in zip(self.model_buffers, buffers):
                    buffer.copy_(saved)
        raise FloatingPointError(
            f"worker {self.worker_id}: the float16 gradient of batch {batch.batch_id} overflowed "
            f"{MAX_OVERFLOW_RETRIES} times, down to loss scale {self.amp.scaler.get_scale():g} "
            f"(training.amp: fp16; the model may have diverged: try bf16 or a lower learning rate)"
        )

    def reach_step(self, step: int) -> None:
        """Step ``step``'s gradient is computed: fire a fault due at it (before anything is sent)."""
        self.faults.reached(
            step, fire=self.fire_fault, announce=lambda fault: self.log.event("fault_injected", fault=str(fault))
        )

    def step_machine(
        self,
        membership: Membership,
        system: Any,
        *,
        placement: Placement | None,
        stats: Callable[[], pb.WorkerStats],
        request_ids: int | None = None,
    ) -> StepMachine:
        """This worker's step machine over its tensors, compressing as the run's ``system`` says (error feedback
        seeded by ``training.seed`` and the worker id), logging to this worker's log."""
        codec = PushCodec.of_worker(system, self.training.seed, self.worker_id, self.names, placement)
        return StepMachine(
            membership, system, names=self.names, params=self.params, buffer_names=self.buffer_names,
            buffers=self.buffers, placement=placement, codec=codec, log=self.log, stats=stats, request_ids=request_ids,
        )  # fmt: skip

    def end_run(self, machine: StepMachine, log_dir: str | Path) -> dict[str, Any]:
        """The run is over (the server took this worker's Finish): the ledger written, ``run_end`` logged with the
        totals the Finish reported, which are returned."""
        stats = machine.finished_stats
        result = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
        feedback = machine.codec.feedback
        self.write_ledger(log_dir, lambda name: feedback.residual(name) if feedback else None)
        self.log.event("run_end", incarnation=machine.membership.incarnation, **result)
        return result

    def write_ledger(self, log_dir: str | Path, residual: Callable[[str], torch.Tensor | None]) -> None:
        """system.gradient_ledger: the gradients computed and the residuals left (``residual(name)``; ``None``:
        none), in ``gradient_ledger.pt``."""
        if self.ledger is None:
            return
        residuals = {
            n: (residual(n) if residual(n) is not None else torch.zeros(p.shape)).to(torch.float64)
            for n, p in zip(self.names, self.model_params)
        }
        torch.save(
            {"computed": dict(zip(self.names, self.ledger)), "residuals": residuals},
            Path(log_dir) / f"worker_{self.worker_id}" / "gradient_ledger.pt",
        )


__all__ = ["MAX_OVERFLOW_RETRIES", "WorkerCompute", "check_layout", "worker_log"]
