"""One parameter-server worker's training state and its step, whoever moves the messages and keeps the time.

:class:`WorkerStep` is what a worker *does* between receiving a reply and sending its next push:
load the reply's parameters (and follow the controller's top-k Active Fraction), compute the
gradient of the handed batches (``system.local_steps`` local SGD steps, one per batch; under
``training.amp`` in autocast, fp16 unscaled by a GradScaler and an overflowed batch computed again
at the lowered scale, :meth:`WorkerStep._forward_backward`), put each
parameter's gradient through error feedback and the compression policy (the exact wire payloads),
build the push, and settle the verdict (commit the residuals, or roll them back and carry the
batches into the next push), and settle what a registration after a failed call finds (a lost
session or a revoked incarnation, :meth:`WorkerStep.rejoined`). Its drivers decide how messages
move and what time it is:

* :class:`src.worker.Worker`: a real process; gRPC calls, wall-clock timings, real waits for
  emulated stragglers and links;
* :class:`src.virtual.worker.VirtualWorker`: a simulated worker of a virtual-time run; the timings
  come from the cost model. Many of them share one compute model: each keeps only its parameter
  replica (what the server last sent it) and its error-feedback residuals, and its replica is copied
  into the shared model before its gradient is computed.

Either way the same code computes the same gradients and payloads from the same replies.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.common.faults import FaultInjector, FaultSpec
from src.compressors.policy import policy_from_config
from src.config import Config, SetupError
from src.metrics import LOG_EVERY_STEPS, MetricsLogger
from src.ps import shard_step
from src.ps.placement import Placement
from src.ps.shard_push import ShardedPushCodec, load_shard_reply
from src.ps.worker_protocol import Failure, PushCodec, controlled_policy, count_push, load_reply, served_tensors
from src.trainer import MixedPrecision, forward_backward
from src.training.lr_schedule import scheduled_learning_rate
from src.transport.wire import Received, tensor_view

MAX_OVERFLOW_RETRIES = 32
"""fp16: computations of one batch before its gradient counts as not finite at any scale (GradScaler halves
the scale at each overflow: 2**16 down to 2**-16)."""

PER_PROCESS_STATS = ("train_loss", "train_accuracy")
"""WorkerStats fields that describe the process so far; the others count from the incarnation's registration."""

TOTALS = (
    "samples",
    "steps",
    "gradient_time_s",
    "compression_time_s",
    "communication_time_s",
    "pushes_rejected",
    "payload_bytes",
    "dense_bytes",
    "train_loss",
    "train_accuracy",
)
"""A worker's running totals (reported with every heartbeat and at Finish)."""


def check_layout(
    worker_id: int,
    config: Config,
    model: nn.Module,
    registration: pb.RegisterReply,
    placement: Placement | None = None,
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


class WorkerStep:
    """One incarnation's training state: its parameters, residuals, carried work and totals.

    Args:
        config: the run's config (as the server sent it, with this worker's local fields).
        worker_id: the worker's id.
        model: the module gradients are computed in (the worker's own, or one shared by simulated workers).
        train_set: the training split (``batch(indices)``).
        device: where ``model`` lives.
        log: this worker's event log.
        replica: ``(parameters, buffers)`` the replies are loaded into when they are not ``model``'s own
            (a simulated worker's replica); default: ``model``'s trainable parameters and float buffers.
        faults: this incarnation's injected faults (:meth:`reach_step` fires them).
        fire_fault: what a due fault does (default: signal this process).
        request_ids: where request ids start (default: a random 62-bit number, so that a restarted
            worker's ids do not collide with its predecessor's).
        placement: the model over a sharded server's shards (:mod:`src.ps.placement`): pushes are encoded per
            shard (:meth:`encode_shards`) and each shard's reply loaded alone (:meth:`load_shard`).
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
        request_ids: int | None = None,
        placement: Placement | None = None,
    ):
        t, system = config.training, config.system
        self.config = config
        self.worker_id = worker_id
        self.model = model
        self.named_params, named_buffers = served_tensors(model)
        self.names = [n for n, _ in self.named_params]
        self.model_params = [p for _, p in self.named_params]
        self.model_buffers = [b for _, b in named_buffers]
        self.params, self.buffers = replica if replica is not None else (self.model_params, self.model_buffers)
        self.train_set = train_set
        self.device = device
        self.log = log
        self.training = t
        self.dense_bytes_per_step = 4 * sum(p.numel() for p in self.model_params)  # what identity payloads carry
        self.codec = PushCodec(
            system,
            policy_from_config(system),
            error_feedback=system.error_feedback,
            seed=t.seed,
            worker_id=worker_id,
            names=self.names,
        )
        self.placement = placement
        self.sharded = ShardedPushCodec(placement, self.codec) if placement is not None else None
        self.amp = MixedPrecision(t.amp, device)  # training.amp: autocast; fp16 with its own GradScaler
        self.faults = faults or FaultInjector((), "worker", worker_id)
        self.fire_fault = fire_fault
        self.request_id = request_ids if request_ids is not None else (random.SystemRandom().getrandbits(62) or 1)
        self.carried: list[pb.Batch] = []  # batches whose rejected gradient waits in the error feedback
        self.version = 0
        self.shard_versions = [0] * (placement.num_shards if placement is not None else 1)
        self.totals: dict[str, Any] = {
            name: 0 if name in ("samples", "steps", "pushes_rejected", "payload_bytes", "dense_bytes") else 0.0
            for name in TOTALS
        }
        self.last_communication_s = 0.0
        self._earlier: dict[str, float] = {}  # what this process reported for its earlier incarnations
        self._epoch = [0.0, 0, 0]  # loss * samples, correct, samples of the running epoch
        # system.gradient_ledger: the sum of every gradient computed (before error feedback), float64
        self.ledger = (
            [torch.zeros(p.shape, dtype=torch.float64) for p in self.model_params] if system.gradient_ledger else None
        )

    # ------------------------------------------------------------------------- replies

    def load(self, received: Received, *, parameters: bool = True) -> int:
        """Take a pull or push reply's parameters, buffers and control; returns its version. ``parameters=False``:
        its version and control only (a sharded server's commit reply: the slices come with the pulls,
        :meth:`load_shard`)."""
        if parameters:
            self.version = load_reply(self.params, self.buffers, received)
        else:
            self.version = received.message.version
        codec = self.codec
        updated = controlled_policy(codec.policy, received.message.control)
        if updated is not codec.policy:  # from the next push on
            self.log.event(
                "control_applied",
                step=self.totals["steps"] + 1,
                compression_ratio=updated.compressor.ratio,
                previous_compression_ratio=codec.policy.compressor.ratio,
                max_staleness=received.message.control.max_staleness,
            )
            codec.policy = updated
        return self.version

    def load_shard(self, shard: int, received: Received) -> int:
        """A sharded server: take shard ``shard``'s reply (its slices, and on shard 0 the buffers); its version,
        which this worker's next push to that shard is based on (:meth:`holds`)."""
        version = load_shard_reply(self.placement, shard, dict(zip(self.names, self.params)), self.buffers, received)
        self.shard_versions[shard] = version
        return version

    def holds(self, request: pb.PushRequest) -> list[pb.PushRequest]:
        """A sharded server: the push's hold to each shard (:func:`src.ps.shard_step.holds`)."""
        return shard_step.holds(request, self.shard_versions)

    def commit(self, request: pb.PushRequest, acks: Sequence[Received | pb.PushReply]) -> pb.PushRequest:
        """A sharded server: the commit to shard 0 after the holds' replies ``acks`` (messages, or as received)
        (:func:`src.ps.shard_step.commit`)."""
        mode = self.config.system.aggregation_mode
        replies = [ack.message if isinstance(ack, Received) else ack for ack in acks]
        return shard_step.commit(request, replies, self.shard_versions[0], mode)

    def shards_apart(self, version: int) -> bool:
        """Whether the shards' slices this worker holds do not fit together after shard 0 answered at ``version``."""
        return shard_step.shards_apart(self.shard_versions, version, self.config.system.aggregation_mode)

    # ------------------------------------------------------------------------- a step

    def compute(self, batches: Sequence[pb.Batch]) -> tuple[float, int, int]:
        """Gradients of the handed batches into the model's ``.grad`` (summed; local SGD steps between them).

        Returns the mean loss, the correct count and the samples. The parameters the step started
        from are what the worker holds afterwards (local steps move only the compute model).
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
        local_lr = scheduled_learning_rate(self.training.lr_schedule, self.training.learning_rate, self.version)
        total_loss, total_correct, total_samples = 0.0, 0, 0
        for index, batch in enumerate(batches):
            images, labels = self.train_set.batch(list(batch.indices))
            loss, correct = self._forward_backward(batch, images.to(self.device), labels.to(self.device))
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

    def _forward_backward(self, batch: pb.Batch, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        """One batch's true gradient into ``.grad`` (``training.amp``: autocast; fp16 unscaled).

        An fp16 gradient that overflowed is not pushed, as GradScaler skips such a step; but the batch
        is this worker's to cover (the server plans every sample into exactly one update), so it is
        computed again at the scale GradScaler lowered, until it is finite: the simplest way that both
        keeps every sample's gradient and never sends an inf. (The batch-norm statistics of the
        overflowed pass are undone.)
        """
        buffers = [b.clone() for b in self.model_buffers] if self.amp.scaler is not None else None
        for _ in range(MAX_OVERFLOW_RETRIES):
            self.model.zero_grad(set_to_none=True)
            loss, correct = forward_backward(self.model, images, labels, self.amp)
            if self.amp.unscale(self.model_params):
                return loss, correct
            self.log.event(
                "amp_overflow",
                step=self.totals["steps"] + 1,
                batch_id=batch.batch_id,
                loss_scale=self.amp.scaler.get_scale(),
            )
            with torch.no_grad():
                for buffer, saved in zip(self.model_buffers, buffers):
                    buffer.copy_(saved)
        raise FloatingPointError(
            f"worker {self.worker_id}: the float16 gradient of batch {batch.batch_id} overflowed "
            f"{MAX_OVERFLOW_RETRIES} times, down to loss scale {self.amp.scaler.get_scale():g} "
            f"(training.amp: fp16; the model may have diverged: try bf16 or a lower learning rate)"
        )

    def reach_step(self) -> None:
        """The step's gradient is computed: fire a fault due at this step (before anything is sent)."""
        self.faults.reached(
            self.totals["steps"] + 1,
            fire=self.fire_fault,
            announce=lambda fault: self.log.event("fault_injected", fault=str(fault)),
        )

    def encode(self, batches: Sequence[pb.Batch]) -> list[bytes]:
        """The push's payloads: each gradient through error feedback and compression (no batches: a flush)."""
        gradients = (
            (name, torch.zeros_like(p) if not batches or p.grad is None else p.grad) for name, p in self.named_params
        )
        if self.sharded is not None:
            raise RuntimeError("a sharded worker encodes per shard: encode_shards")
        return self.codec.encode(gradients, self.totals["steps"])

    def encode_part(self, index: int, batches: Sequence[pb.Batch]) -> Any:
        """A streamed push (``system.streaming``): gradient ``index``'s payload alone, as soon as backward has
        produced it (:mod:`src.ps.worker_stream`); the same error feedback and compression as :meth:`encode`'s
        (a compressor that draws random numbers draws them in the order the gradients come)."""
        name, param = self.named_params[index]
        gradient = torch.zeros_like(param) if not batches or param.grad is None else param.grad
        return self.codec.encode([(name, gradient)], self.totals["steps"])[0]

    def encode_slice(self, shard: int, position: int, batches: Sequence[pb.Batch]) -> Any:
        """A streamed push to a sharded server: shard ``shard``'s slice ``position`` alone, once its tensor's
        gradient is whole (:meth:`ShardedPushCodec.encode_slice <src.ps.shard_push.ShardedPushCodec.encode_slice>`)."""
        name = self.placement.on_shard(shard)[position].name
        param = self.model_params[self.names.index(name)]
        gradient = torch.zeros_like(param) if not batches or param.grad is None else param.grad
        return self.sharded.encode_slice(shard, position, gradient, self.totals["steps"])

    def encode_shards(self, batches: Sequence[pb.Batch]) -> list[list[bytes]]:
        """A sharded server: each shard's payloads, one per slice (:class:`~src.ps.shard_push.ShardedPushCodec`)."""
        gradients = (
            (name, torch.zeros_like(p) if not batches or p.grad is None else p.grad) for name, p in self.named_params
        )
        return self.sharded.encode(gradients, self.totals["steps"])

    def request(
        self,
        caller: pb.Caller,
        batches: Sequence[pb.Batch],
        loss: float,
        correct: int,
        *,
        gradient_time_s: float,
        compression_time_s: float,
    ) -> pb.PushRequest:
        """The push covering the carried and the new batches (a new request id)."""
        self.request_id += 1
        covered = self.carried + list(batches)
        return pb.PushRequest(
            caller=caller,
            base_version=self.version,
            request_id=self.request_id,
            num_samples=sum(len(b.indices) for b in covered),
            batch_ids=[b.batch_id for b in covered],
            metrics=pb.StepMetrics(
                epoch=batches[-1].epoch if batches else 0,
                step=self.totals["steps"],
                loss=loss,
                correct=correct,
                gradient_time_s=gradient_time_s,
                compression_time_s=compression_time_s,
                communication_time_s=self.last_communication_s,
            ),
        )

    def buffers_to_send(self, batches: Sequence[pb.Batch]) -> list[memoryview]:
        """The model's float buffers after the step (none for a flush)."""
        return [tensor_view(b) for b in self.model_buffers] if batches else []

    def settle(
        self,
        reply: Received,
        batches: Sequence[pb.Batch],
        request: pb.PushRequest,
        *,
        payload_bytes: int,
        loss: float,
        correct: int,
        samples: int,
        gradient_time_s: float,
        compression_time_s: float,
        communication_time_s: float,
        push_bytes: int,
        reply_bytes: int,
        bytes_sent: int,
        bytes_received: int,
        parameters: bool = True,
    ) -> None:
        """The push's verdict: commit or roll back the residuals, carry rejected batches, load the reply, count.
        ``parameters=False``: the reply's version and control only (its tensors arrive by themselves: a sharded
        server's pulls, a streamed reply)."""
        accepted = reply.message.accepted
        if self.sharded is not None:  # one verdict for every shard's slices, but async a shard's own rollback
            for shard in range(self.placement.num_shards):
                self.sharded.settle(shard, accepted=shard_step.applied_on(reply.message, shard))
        else:
            self.codec.settle(accepted=accepted)
        self.carried = [] if accepted else self.carried + list(batches)
        totals = self.totals
        count_push(
            totals,
            accepted=accepted,
            samples=samples,
            gradient_time_s=gradient_time_s,
            compression_time_s=compression_time_s,
            communication_time_s=communication_time_s,
            payload_bytes=payload_bytes,
            dense_bytes=self.dense_bytes_per_step,
        )
        self.last_communication_s = communication_time_s
        self.load(reply, parameters=parameters and self.sharded is None)  # a new Active Fraction: from the next step
        epoch = self._epoch
        epoch[0] += loss * samples
        epoch[1] += correct
        epoch[2] += samples
        totals["train_loss"] = epoch[0] / max(epoch[2], 1)
        totals["train_accuracy"] = epoch[1] / max(epoch[2], 1)
        self.log.event(
            "push",
            step=totals["steps"],
            num_samples=samples,
            batch_ids=list(request.batch_ids),
            payload_bytes=payload_bytes,
            push_bytes=push_bytes,
            reply_bytes=reply_bytes,
            accepted=accepted,
            staleness=reply.message.staleness,
            version=self.version,
        )
        if totals["steps"] % LOG_EVERY_STEPS == 0 or reply.message.work.finished:
            step_s = gradient_time_s + compression_time_s + communication_time_s
            self.log.scalars(
                "train",
                totals["steps"],
                {
                    "loss": loss,
                    "accuracy": correct / samples if samples else 0.0,
                    "throughput": samples / step_s if step_s > 0 else 0.0,
                    "gradient_time_s": gradient_time_s,
                    "compression_time_s": compression_time_s,
                    "communication_time_s": communication_time_s,
                    "samples_processed": totals["samples"],
                    "bytes_sent": bytes_sent,
                    "bytes_received": bytes_received,
                    "compression_ratio": totals["dense_bytes"] / max(totals["payload_bytes"], 1),
                    "staleness": reply.message.staleness,
                },
            )

    def carried_to_register(self, failure: Failure) -> list[pb.Batch]:
        """The batches to tell the server this process still carries when it registers again after ``failure``:
        its own after a lost session (they stay with it); none after a revocation (the server handed
        them to the live workers when it failed this incarnation)."""
        return self.carried if failure == "lost" else []

    def rejoined(self, failure: Failure, *, in_flight: bool, applied: bool) -> None:
        """Registered again after ``failure`` (:func:`src.ps.worker_protocol.failed_call`).

        ``in_flight``: the reply of a push was lost; the registration says whether the server applied
        it (commit: its batches are done). Not applied, after a lost session: discard it (the
        restarted server hands its samples back to this worker, which computes them again); after a
        revocation: roll it back into the residual (no gradient mass is lost: it goes with the next
        push), as the gradients of the carried batches stay there, while the batches themselves are
        no longer this worker's (the server reassigned them; they are not listed again).
        """
        if in_flight:
            if self.sharded is not None:
                for shard in range(self.placement.num_shards):
                    self.sharded.settle_lost(shard, applied=applied, redone=failure == "lost")
            else:
                self.codec.settle_lost(applied=applied, redone=failure == "lost")
        if applied or failure == "revoked":
            self.carried = []

    def begin_incarnation(self, reported: pb.WorkerStats) -> None:
        """A new incarnation of this process registered: its stats count from here (``reported``: what
        :meth:`stats` says now, which stays with the earlier incarnations in the run summary)."""
        # One new dict, assigned at once: the heartbeat thread reads it meanwhile.
        self._earlier = {
            field.name: self._earlier.get(field.name, 0) + getattr(reported, field.name)
            for field in pb.WorkerStats.DESCRIPTOR.fields
            if field.name not in PER_PROCESS_STATS
        }

    # ------------------------------------------------------------------------- the end

    def stats(
        self, *, bytes_sent: int, bytes_received: int, total_time_s: float, emulated_delay_s: float
    ) -> pb.WorkerStats:
        """The running totals of this incarnation, as the heartbeat and Finish report them (the
        arguments count for the process: what earlier incarnations reported is taken off)."""
        t = self.totals
        stats = pb.WorkerStats(
            samples=t["samples"],
            steps=t["steps"],
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            gradient_time_s=t["gradient_time_s"],
            compression_time_s=t["compression_time_s"],
            communication_time_s=t["communication_time_s"],
            total_time_s=total_time_s,
            train_loss=t["train_loss"],
            train_accuracy=t["train_accuracy"],
            pushes_rejected=t["pushes_rejected"],
            payload_bytes=t["payload_bytes"],
            dense_bytes=t["dense_bytes"],
            emulated_delay_s=emulated_delay_s,
        )
        for name, earlier in self._earlier.items():
            setattr(stats, name, getattr(stats, name) - type(getattr(stats, name))(earlier))
        return stats

    def write_ledger(self, log_dir: str | Path) -> None:
        """system.gradient_ledger: the gradients computed and the residuals left (``gradient_ledger.pt``)."""
        if self.ledger is None:
            return
        feedback = self.codec.feedback
        residuals = {
            n: (
                feedback.residual(n)
                if feedback is not None and feedback.residual(n) is not None
                else torch.zeros(p.shape)
            ).to(torch.float64)
            for n, p in self.named_params
        }
        torch.save(
            {"computed": dict(zip(self.names, self.ledger)), "residuals": residuals},
            Path(log_dir) / f"worker_{self.worker_id}" / "gradient_ledger.pt",
        )
