"""The parameter server: holds the model and a server-side optimizer, and serves workers over gRPC.

A run has ``system.num_workers`` workers with ids ``0..N-1``; worker ``k`` reads shard ``k`` of every
epoch (:func:`src.data.make_shards`). Workers register, then loop pull -> compute -> push, and
finish when they have taken all their steps. The server's version counts optimizer steps.

* **sync** (``system.aggregation_mode: sync``): one barrier per version. When every live worker's
  gradient for version ``v`` is in, the server averages them weighted by sample count,
  ``sum n_k g_k / sum n_k`` (exactly the large-batch gradient, also for a short or empty last
  batch), steps the optimizer, moves to ``v + 1`` and releases the pulls waiting for it. A worker
  that finished leaves the barrier, so the others never wait for it.
* **async**: each push is applied when it arrives. Its staleness ``tau = version - base_version``
  is recorded and handed to the staleness policy (:class:`~src.staleness.StalenessPolicy`,
  ``system.staleness_policy``), which returns the weight to apply it with, or ``None`` to turn it
  away (the worker then rolls back its error feedback). The default policy applies every push at
  full weight. With ``system.async_correction: lookahead`` (the default) the optimizer is
  :class:`~src.staleness.LookaheadMomentum` (per-worker momentum, ``lr/N`` per push) and pulls send
  its lookahead point; ``implicit_momentum`` lowers the momentum by ``1 - 1/N``.

Every push is checked before it touches the model: registered worker, one payload per parameter
with the parameter's shape, a well-formed payload (the compression library's header and checksum),
finite values. A bad push is refused with a gRPC status naming the problem and the server keeps
serving. A push carries a request id; a retry of an applied push gets the first reply again and is
not applied twice.

Outputs under ``system.log_dir/server``: ``events.jsonl`` (register, push with staleness, eval,
checkpoint, run end) and TensorBoard scalars; checkpoints in ``system.checkpoint_dir`` every
``training.checkpoint_interval`` versions (written in the background) and
``parameter_server_final.pt`` at the end, in the common checkpoint format.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.checkpoint import KEEP_CHECKPOINTS, final_checkpoint_path, make_checkpoint, numbered_path, prune_checkpoints, save_checkpoint
from src.compression import decompress, parse_header
from src.config import Config
from src.data import load_dataset
from src.metrics import MetricsLogger, write_summary
from src.ps_transport import Outgoing, Received, check_float32_bytes, require_auth_token, serialize, split, start_grpc_server, tensor_view
from src.staleness import LookaheadMomentum, StalenessPolicy, compensated_momentum
from src.trainer import evaluate, model_from_config, optimizer_from_config

REMEMBERED_REQUESTS = 64  # per worker: far more than one worker can have in flight
PULL_POLL_S = 1.0  # a waiting pull wakes this often to notice a cancelled call


def compression_label(config: Config) -> str:
    """How gradients travel, for summaries: ``none``, ``topk(0.1)``, ``quantization(8)``."""
    system = config.system
    if not system.compression_enabled:
        return "none"
    if system.compression_type == "topk":
        return f"topk({system.compression_ratio:g})"
    return f"quantization({system.quantization_bits})"


class PushRefused(Exception):
    """A request that must be refused with ``code``; ``message`` says what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Contribution:
    """One decoded, validated push waiting in (or going through) the server."""

    num_samples: int
    gradients: list[torch.Tensor]
    buffers: list[torch.Tensor]
    epoch: int
    last_in_epoch: bool


def _spec(name: str, tensor: torch.Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, shape=list(tensor.shape))


class ParameterServer:
    """The gRPC service (:func:`~src.ps_transport.service_handler`) and the model state behind it.

    Args:
        config: the run's config (mode, workers, optimizer, outputs).
        token: the auth token every RPC must carry (default: :func:`require_auth_token`).
        model: a model to serve instead of ``model_from_config(config)`` (benchmarks).
        staleness_policy: async weight-or-reject policy (default: ``StalenessPolicy.from_config(config.system)``).
        evaluate: evaluate on the test split at epoch ends and at the end (needs a model that
            takes the dataset's images).
        tensorboard: also write TensorBoard scalars next to ``events.jsonl``.

    Use: :meth:`start` -> workers train -> :meth:`wait_until_done` -> :meth:`finalize` -> :meth:`stop`.
    """

    def __init__(
        self,
        config: Config,
        *,
        token: str | None = None,
        model: nn.Module | None = None,
        staleness_policy: StalenessPolicy | None = None,
        evaluate: bool = True,
        tensorboard: bool = True,
    ):
        self.config = config
        self.token = token or require_auth_token(config.system)
        self.mode = config.system.aggregation_mode
        self.num_workers = config.system.num_workers
        self.staleness_policy = staleness_policy or StalenessPolicy.from_config(config.system)
        self.model = model if model is not None else model_from_config(config)
        self.optimizer = self._make_optimizer(config)
        named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        named_buffers = [(n, b) for n, b in self.model.named_buffers() if b.is_floating_point()]
        self.params = [p for _, p in named_params]
        self.buffers = [b for _, b in named_buffers]
        self.param_specs = [_spec(n, p) for n, p in named_params]
        self.buffer_specs = [_spec(n, b) for n, b in named_buffers]
        self._param_shapes = [tuple(p.shape) for p in self.params]
        self._buffer_shapes = [tuple(b.shape) for b in self.buffers]
        # Byte views of the model's tensors, made once: the optimizer updates them in place, so each
        # version's pull reply serializes the current values (the server's model is contiguous CPU float32).
        self._state_views = [tensor_view(t) for t in self.params + self.buffers]
        if isinstance(self.optimizer, LookaheadMomentum):  # pulls send the lookahead point, computed into these
            self._lookahead = [torch.empty_like(p) for p in self.params]
            self._state_views[:len(self.params)] = [tensor_view(t) for t in self._lookahead]
        self._gradient_sums: list[torch.Tensor] | None = None  # sync: reused for every barrier
        model_bytes = 4 * sum(p.numel() for p in self.params + self.buffers)
        # A push is at most ~2x the model (top-k at ratio 1 sends value + index per entry).
        self.max_message_bytes = min(3 * model_bytes + (4 << 20), 2**31 - 1)
        self.test_set = None
        if evaluate:
            t = config.training
            self.test_set = load_dataset(t.dataset, "test", data_dir=t.data_dir, max_samples=t.max_test_samples,
                                         num_samples=t.num_samples, seed=t.seed)
            self._eval_model = copy.deepcopy(self.model)

        self._cond = threading.Condition()
        self.version = 0
        self._registered: dict[int, str] = {}
        self._finished: dict[int, dict[str, Any]] = {}
        self._barrier: dict[int, _Contribution] = {}
        self._requests: dict[int, OrderedDict[int, pb.PushReply | None]] = {}
        self._epoch_ends: Counter[int] = Counter()
        self._pull_reply: tuple[int, bytes] | None = None  # (version, serialized PullReply)
        self._stopping = False
        self._done = threading.Event()
        self.pushes_applied = self.pushes_rejected = self.pushes_refused = 0
        self._staleness_sum, self._staleness_count, self.max_staleness = 0, 0, 0
        self._first_register_time: float | None = None
        self._last_finish_time: float | None = None
        self._checkpoint_pending = False

        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-background")
        self.log = MetricsLogger(Path(config.system.log_dir) / "server", tensorboard=tensorboard, role="server")
        self.log.event("run_start", architecture="parameter_server", config=self.config.to_dict())
        self._grpc_server: grpc.Server | None = None
        self.port: int | None = None

    def _make_optimizer(self, config: Config) -> torch.optim.Optimizer:
        t, system = config.training, config.system
        if self.mode == "async" and system.async_correction == "lookahead" and t.optimizer == "sgd":
            return LookaheadMomentum.from_config(config, self.model.parameters())
        if self.mode == "async" and system.async_correction == "implicit_momentum":
            momentum = compensated_momentum(t.momentum, system.num_workers)
            config = config.model_copy(update={"training": t.model_copy(update={"momentum": momentum})})
        # fused: one pass per tensor; it only reads the gradients, which are views of the push (see _decode)
        return optimizer_from_config(config, self.model.parameters(), fused=True)

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> int:
        """Serve on ``system.server_address``; returns the bound port (a free one for port 0)."""
        self._grpc_server, self.port = start_grpc_server(
            self, self.config.system, token=self.token, max_message_bytes=self.max_message_bytes,
            max_threads=2 * self.num_workers + 8,  # one waiting pull per worker, plus pushes and status
        )
        self.log.event("listening", address=self.config.system.server_address, port=self.port)
        return self.port

    def wait_until_done(self, timeout: float | None = None) -> bool:
        """Block until every worker has finished (or ``timeout`` seconds); returns whether they had."""
        return self._done.wait(timeout)

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving: waiting pulls return ``finished``, then the gRPC server shuts down."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._grpc_server is not None:
            self._grpc_server.stop(grace).wait()
        self._background.shutdown(wait=True)
        self.log.close()

    # ------------------------------------------------------------------------- RPCs

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> bytes:
        worker_id = request.worker_id
        if not 0 <= worker_id < self.num_workers:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"worker_id {worker_id} is out of range 0..{self.num_workers - 1} (system.num_workers={self.num_workers})")
        with self._cond:
            if worker_id in self._finished:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker_id} has already finished this run")
            self._registered[worker_id] = context.peer()
            if self._first_register_time is None:
                self._first_register_time = time.perf_counter()
            self._requests.setdefault(worker_id, OrderedDict())
            version = self.version
            reply = serialize(Outgoing(
                pb.RegisterReply(
                    worker_id=worker_id, shard=pb.Shard(rank=worker_id, num_shards=self.num_workers), version=version,
                    run_config_json=self.config.model_dump_json(),
                    parameter_specs=self.param_specs, buffer_specs=self.buffer_specs,
                ),
                {"parameters": [tensor_view(p) for p in self.params], "buffers": [tensor_view(b) for b in self.buffers]},
            ))
        self.log.event("register", worker=worker_id, peer=context.peer(), version=version)
        return reply

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes | pb.PullReply:
        self._require_registered(request.worker_id, context)
        with self._cond:
            while self.version < request.min_version and not self._stopping:
                self._cond.wait(PULL_POLL_S)
                if not context.is_active():
                    return pb.PullReply()
            if self.version < request.min_version:  # stopping before the barrier completed
                return pb.PullReply(version=self.version, finished=True)
            return self._serialized_pull_reply()

    def Push(self, data: bytes, context: grpc.ServicerContext) -> pb.PushReply:
        try:
            received = split(data, pb.PushRequest, ("gradients", "buffers"))
        except ValueError as exc:
            with self._cond:
                self.pushes_refused += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"push: {exc}")
        request = received.message
        worker_id, request_id = request.worker_id, request.request_id
        try:
            with self._cond:
                self._check_live(worker_id)
                remembered = self._requests[worker_id]
                while request_id in remembered and remembered[request_id] is None:
                    self._cond.wait()  # the first copy of this request is still being handled
                if request_id in remembered:
                    return remembered[request_id]  # a retry: answer again, apply nothing
                remembered[request_id] = None
            try:
                contribution = self._decode(received)  # outside the lock: workers decode in parallel
                with self._cond:
                    self._check_live(worker_id)
                    reply, epoch_ended = (self._add_to_barrier if self.mode == "sync" else self._apply_now)(
                        worker_id, request.base_version, contribution)
                    remembered[request_id] = reply
                    while len(remembered) > REMEMBERED_REQUESTS:
                        remembered.popitem(last=False)
                    self._cond.notify_all()
            except BaseException:
                with self._cond:
                    remembered.pop(request_id, None)
                    self._cond.notify_all()
                raise
        except PushRefused as refused:
            with self._cond:
                self.pushes_refused += 1
            self.log.event("push_refused", worker=worker_id, request_id=request_id, code=refused.code.name, reason=refused.message)
            context.abort(refused.code, refused.message)
        self.log.event("push", worker=worker_id, base_version=request.base_version, version=reply.version,
                       staleness=reply.staleness, accepted=reply.accepted, num_samples=request.num_samples,
                       epoch=request.metrics.epoch, step=request.metrics.step, loss=request.metrics.loss)
        if epoch_ended is not None:
            self._epoch_finished(epoch_ended)
        return reply

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        worker_id = request.worker_id
        self._require_registered(worker_id, context)
        stats = {field.name: getattr(request.stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
        epoch_ended = None
        with self._cond:
            first_time = worker_id not in self._finished
            if first_time:
                self._finished[worker_id] = {"worker_id": worker_id, **stats}
                self._last_finish_time = time.perf_counter()
                if isinstance(self.optimizer, LookaheadMomentum):
                    self.optimizer.forget_worker(worker_id)  # its momentum will not be applied any more
                if self.mode == "sync":
                    epoch_ended = self._maybe_complete_barrier()  # it no longer holds the others back
                if len(self._finished) == self.num_workers and not self._barrier:
                    self._done.set()
                self._cond.notify_all()
            version = self.version
        if first_time:
            self.log.event("worker_finished", worker=worker_id, version=version, **stats)
        if epoch_ended is not None:
            self._epoch_finished(epoch_ended)
        return pb.FinishReply(version=version)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        with self._cond:
            return pb.StatusReply(
                version=self.version, aggregation_mode=self.mode, num_workers=self.num_workers,
                registered=sorted(self._registered), finished=sorted(self._finished),
                pushes_applied=self.pushes_applied, pushes_rejected=self.pushes_rejected,
                pushes_refused=self.pushes_refused, done=self._done.is_set(),
            )

    # ------------------------------------------------------------------------- validation

    def _require_registered(self, worker_id: int, context: grpc.ServicerContext) -> None:
        with self._cond:
            known = worker_id in self._registered
        if not known:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker_id} is not registered")

    def _check_live(self, worker_id: int) -> None:
        if worker_id not in self._registered:
            raise PushRefused(grpc.StatusCode.FAILED_PRECONDITION, f"push from worker {worker_id}, which is not registered")
        if worker_id in self._finished:
            raise PushRefused(grpc.StatusCode.FAILED_PRECONDITION, f"push from worker {worker_id}, which has finished")

    def _decode(self, received: Received) -> _Contribution:
        """Check and decompress a push; raises :class:`PushRefused` (INVALID_ARGUMENT) naming the problem."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        request, payloads, raw_buffers = received.message, received.large["gradients"], received.large["buffers"]
        num_samples = request.num_samples
        metrics = request.metrics
        if num_samples < 0:
            raise PushRefused(invalid, f"num_samples must be >= 0, got {num_samples}")
        if num_samples == 0:
            if payloads or raw_buffers:
                raise PushRefused(invalid, f"an empty step (num_samples=0) carries no tensors, got "
                                           f"{len(payloads)} gradients and {len(raw_buffers)} buffers")
            return _Contribution(0, [], [], metrics.epoch, metrics.last_in_epoch)
        if len(payloads) != len(self.params):
            raise PushRefused(invalid, f"push carries {len(payloads)} gradients, the model has {len(self.params)} parameters")
        gradients = []
        for index, (payload, spec, shape) in enumerate(zip(payloads, self.param_specs, self._param_shapes)):
            what = f"gradient {index} ({spec.name})"
            try:
                header = parse_header(payload)  # before decompressing: the header bounds the allocation
                if header.shape != shape:
                    raise ValueError(f"shape {list(header.shape)}, expected {list(shape)}")
                # copy=False: identity gradients stay read-only views of the message (nothing writes them)
                gradient = decompress(payload, copy=False)  # refuses malformed buffers and NaN/Inf values
                gradients.append(gradient)
            except ValueError as exc:
                raise PushRefused(invalid, f"{what}: {exc}") from None
        buffers = []
        if raw_buffers:
            if len(raw_buffers) != len(self.buffers):
                raise PushRefused(invalid, f"push carries {len(raw_buffers)} buffers, the model has {len(self.buffers)}")
            for data, spec, shape in zip(raw_buffers, self.buffer_specs, self._buffer_shapes):
                try:
                    check_float32_bytes(data, math.prod(shape), f"buffer {spec.name}")
                except ValueError as exc:
                    raise PushRefused(invalid, str(exc)) from None
                values = torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
                if not bool(torch.isfinite(values).all()):
                    raise PushRefused(invalid, f"buffer {spec.name}: holds NaN or Inf values")
                buffers.append(values)
        return _Contribution(num_samples, gradients, buffers, metrics.epoch, metrics.last_in_epoch)

    # ------------------------------------------------------------------------- aggregation (lock held)

    def _add_to_barrier(self, worker_id: int, base_version: int, contribution: _Contribution) -> tuple[pb.PushReply, int | None]:
        if base_version != self.version:
            raise PushRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"sync push for version {base_version}, but the barrier is at version {self.version}")
        if worker_id in self._barrier:
            raise PushRefused(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker_id} already pushed for version {base_version}")
        self._barrier[worker_id] = contribution
        epoch_ended = self._maybe_complete_barrier()
        return pb.PushReply(accepted=True, version=self.version, staleness=0), epoch_ended

    def _maybe_complete_barrier(self) -> int | None:
        """Step when every live worker is in; returns the epoch that ended with this step, if one did."""
        live = [w for w in range(self.num_workers) if w not in self._finished]
        if not self._barrier or any(w not in self._barrier for w in live):
            return None
        contributions = [self._barrier[w] for w in sorted(self._barrier)]  # fixed order: reproducible sums
        total = sum(c.num_samples for c in contributions)
        if total > 0:
            with_samples = [c for c in contributions if c.num_samples > 0]
            if len(with_samples) == 1:  # the weighted average of one gradient is that gradient
                gradients = with_samples[0].gradients
            else:  # sum n_k g_k / sum n_k, into buffers reused from barrier to barrier
                if self._gradient_sums is None:
                    self._gradient_sums = [torch.empty_like(p, dtype=torch.float32) for p in self.params]
                gradients = self._gradient_sums
                first, *rest = with_samples
                for summed, g in zip(gradients, first.gradients):
                    torch.mul(g, first.num_samples, out=summed)
                for c in rest:
                    for summed, g in zip(gradients, c.gradients):
                        summed.add_(g, alpha=c.num_samples)
                for summed in gradients:
                    summed.div_(total)
            buffers = []
            with_buffers = [c for c in contributions if c.buffers]
            if len(with_buffers) == 1:
                buffers = with_buffers[0].buffers
            elif with_buffers:
                weight = sum(c.num_samples for c in with_buffers)
                buffers = [sum(c.buffers[i] * (c.num_samples / weight) for c in with_buffers) for i in range(len(self.buffers))]
            self._step(gradients, buffers)
        self.version += 1
        self.pushes_applied += len(contributions)
        self._barrier.clear()
        if len(self._finished) == self.num_workers:
            self._done.set()
        self._after_version()
        return self._count_epoch_ends(contributions)

    def _apply_now(self, worker_id: int, base_version: int, contribution: _Contribution) -> tuple[pb.PushReply, int | None]:
        if base_version > self.version:
            raise PushRefused(grpc.StatusCode.INVALID_ARGUMENT, f"base_version {base_version} is ahead of the server's version {self.version}")
        staleness = self.version - base_version
        self._staleness_sum += staleness
        self._staleness_count += 1
        self.max_staleness = max(self.max_staleness, staleness)
        reply = pb.PushReply(accepted=True, staleness=staleness)
        if contribution.num_samples > 0:
            weight, reason = self.staleness_policy.verdict(staleness)
            if weight is None:
                self.pushes_rejected += 1
                reply.accepted = False
                reply.reason = f"rejected by the staleness policy: {reason}"
            else:
                # Out of place: the gradients may be read-only views of the push.
                gradients = contribution.gradients if weight == 1.0 else [g * weight for g in contribution.gradients]
                self._step(gradients, contribution.buffers, worker=worker_id)
                self.version += 1
                self.pushes_applied += 1
                self._after_version()
        reply.version = self.version
        return reply, self._count_epoch_ends([contribution])

    def _step(self, gradients: list[torch.Tensor], buffers: list[torch.Tensor], worker: int | None = None) -> None:
        """One optimizer step with ``gradients`` (read, never written) and the new buffer values."""
        for param, gradient in zip(self.params, gradients):
            param.grad = gradient.to(param.device)
        if isinstance(self.optimizer, LookaheadMomentum):
            self.optimizer.step(worker=worker)
        else:
            self.optimizer.step()
        with torch.no_grad():
            for param in self.params:
                param.grad = None  # do not keep the push's message alive until the next step
            for buffer, value in zip(self.buffers, buffers):
                buffer.copy_(value)

    def _count_epoch_ends(self, contributions: list[_Contribution]) -> int | None:
        ended = None
        for c in contributions:
            if c.last_in_epoch:
                self._epoch_ends[c.epoch] += 1
                if self._epoch_ends[c.epoch] == self.num_workers:
                    ended = c.epoch
        return ended

    def _serialized_pull_reply(self) -> bytes:
        """The PullReply of the current version, serialized once for every worker that pulls it (lock held)."""
        if self._pull_reply is None or self._pull_reply[0] != self.version:
            if isinstance(self.optimizer, LookaheadMomentum):
                self.optimizer.lookahead(out=self._lookahead)
            views = self._state_views
            self._pull_reply = (self.version, serialize(Outgoing(
                pb.PullReply(version=self.version),
                {"parameters": views[:len(self.params)], "buffers": views[len(self.params):]},
            )))
        return self._pull_reply[1]

    # ------------------------------------------------------------------------- evaluation, checkpoints

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def _after_version(self) -> None:
        interval = self.config.training.checkpoint_interval
        if self.version % interval == 0 and not self._checkpoint_pending:
            self._checkpoint_pending = True  # a slow disk skips checkpoints instead of queueing them
            state, optimizer_state = self._snapshot(), copy.deepcopy(self.optimizer.state_dict())
            epochs_done = sum(1 for count in self._epoch_ends.values() if count == self.num_workers)
            self._background.submit(self._write_numbered_checkpoint, self.version, epochs_done, state, optimizer_state)

    def _checkpoint(self, path: Path, state: dict[str, torch.Tensor], optimizer_state: dict, version: int, epoch: int) -> Path:
        checkpoint = make_checkpoint(
            model_state_dict=state, optimizer_state_dict=optimizer_state,
            model_architecture=self.config.training.model_architecture, dataset=self.config.training.dataset,
            epoch=epoch, step=version, config=self.config.to_dict(),
            extra={"version": version, "aggregation_mode": self.mode, "num_workers": self.num_workers},
        )
        return save_checkpoint(path, checkpoint)

    def _write_numbered_checkpoint(self, version: int, epoch: int, state: dict, optimizer_state: dict) -> None:
        try:
            directory = Path(self.config.system.checkpoint_dir)
            written = self._checkpoint(numbered_path(directory, version), state, optimizer_state, version, epoch)
            prune_checkpoints(directory, KEEP_CHECKPOINTS)
            self.log.event("checkpoint", path=str(written), version=version)
        finally:
            with self._cond:
                self._checkpoint_pending = False

    def _epoch_finished(self, epoch: int) -> None:
        """Every worker has pushed its last step of ``epoch``: evaluate a snapshot in the background."""
        if self.test_set is None or epoch + 1 >= self.config.training.num_epochs:
            return  # the final evaluation covers the last epoch
        with self._cond:
            state, version = self._snapshot(), self.version
        self._background.submit(self._evaluate_snapshot, epoch + 1, version, state)

    def _evaluate_snapshot(self, epoch: int, version: int, state: dict[str, torch.Tensor]) -> None:
        self._eval_model.load_state_dict(state)
        self._record_eval(epoch, version, self._eval_model)

    def _record_eval(self, epoch: int, version: int, model: nn.Module) -> tuple[float, float]:
        t = self.config.training
        loss, accuracy = evaluate(model, self.test_set, batch_size=t.eval_batch_size)
        self.log.scalars("eval", version, {"test_loss": loss, "test_accuracy": accuracy}, epoch=epoch)
        print(f"epoch {epoch}/{t.num_epochs}: test accuracy {accuracy * 100:.2f}%, test loss {loss:.4f} (server version {version})", flush=True)
        return loss, accuracy

    def finalize(self, summary_json: str | Path | None = None) -> dict[str, Any]:
        """After every worker finished: final evaluation, final checkpoint, run summary (returned and written).

        Args:
            summary_json: where to write the summary (default ``<log_dir>/summary.json``).
        """
        self._background.submit(lambda: None).result()  # let a pending checkpoint or evaluation finish first
        t = self.config.training
        with self._cond:
            version = self.version
            workers = [self._finished[w] for w in sorted(self._finished)]
        final_loss, final_accuracy = self._record_eval(t.num_epochs, version, self.model) if self.test_set is not None else (float("nan"), float("nan"))
        checkpoint_path = self._checkpoint(final_checkpoint_path(self.config.system.checkpoint_dir, "parameter_server"),
                                           self._snapshot(), self.optimizer.state_dict(), version, t.num_epochs)
        start = self._first_register_time or time.perf_counter()
        train_time = (self._last_finish_time or start) - start
        samples = sum(w["samples"] for w in workers)
        summary = {
            "architecture": "parameter_server",
            "dataset": t.dataset,
            "num_workers": self.num_workers,
            "aggregation_mode": self.mode,
            "final_accuracy": final_accuracy,
            "final_loss": final_loss,
            "total_time_s": time.perf_counter() - start,
            "train_time_s": train_time,
            "throughput_samples_per_s": samples / train_time if train_time > 0 else 0.0,
            "samples_processed": samples,
            "bytes_sent": sum(w["bytes_sent"] for w in workers),
            "bytes_received": sum(w["bytes_received"] for w in workers),
            "compression": compression_label(self.config),
            "checkpoint_path": str(checkpoint_path),
            "epochs": t.num_epochs,
            "versions": version,
            "pushes_applied": self.pushes_applied,
            "pushes_rejected": self.pushes_rejected,
            "pushes_refused": self.pushes_refused,
            "mean_staleness": self._staleness_sum / max(self._staleness_count, 1),
            "max_staleness": self.max_staleness,
            "gradient_time_s": sum(w["gradient_time_s"] for w in workers),
            "compression_time_s": sum(w["compression_time_s"] for w in workers),
            "communication_time_s": sum(w["communication_time_s"] for w in workers),
            "workers": workers,
        }
        self.log.event("run_end", **{k: v for k, v in summary.items() if k != "workers"})
        write_summary(summary_json or Path(self.config.system.log_dir) / "summary.json", summary)
        return summary
