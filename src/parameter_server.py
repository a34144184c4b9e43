"""The parameter server's gRPC service: who may call, what a call must hold, and the run around them.

The algorithms live one floor down and this module wires them to RPCs: membership and work
assignment in :mod:`src.coordinator`, the versions, sync barrier and de-dup in
:mod:`src.aggregation`, the staleness verdicts in the configured policy. This module owns
authentication of each call to a registration, validation of every push, the waits, the heartbeat
monitor, evaluation, checkpoints (and resuming from one), events and the run summary.

A run has ``system.num_workers`` worker ids. A worker registers (a new incarnation, with a session
secret every later call must carry), pulls the parameters and its first work, then loops: train on
the batches it was handed -> push the gradient -> the reply carries the verdict, the parameters to
train on next and the next batches (one RPC per step). When every batch of every epoch is in an
applied update, replies say ``finished`` and the workers send Finish with their totals.

* **sync**: one barrier per version among the workers handed work for it (see
  :class:`src.coordinator.WorkPlan`); the sample-weighted mean of their gradients is one optimizer
  step, so N workers of batch b take the baseline's steps at batch N*b. The first round starts when
  all ``num_workers`` workers are ready.
* **async**: each push is judged by the staleness policy (weight, or reject: the worker then rolls
  its error feedback back and the push's batches stay with it, carried into its next push) and
  applied at once.

Failures: a worker silent for ``system.heartbeat_timeout`` (dead or hung), or replaced by a new
incarnation, is failed: it leaves the sync barrier with its not-yet-applied contribution, and
everything it held or had queued goes to the live workers. Calls from a failed incarnation are
refused. With ``resume``, the server continues from its own checkpoint (parameters, optimizer,
version, work progress, de-dup outcomes, totals); updates after that checkpoint are lost and their
samples are redone.

Emulated links (:mod:`src.netem`, the config's ``emulation`` section): a Pull or Push reply to a
worker with a narrow downlink waits its transfer time (from its exact serialized size) after it is
built, outside the lock, before it is returned to gRPC; the summary's ``emulation`` says what was on.

A server may also start without a model (a subclass's :meth:`ParameterServer._served_model`
returns ``None``, see :mod:`src.torch_asgc.server`): Register then answers ``model_wanted`` and the
first worker's Initialize installs the layout and initial values (:func:`src.served_model.model_from_layout`);
checkpoints record the layout, so such a server resumes without any worker.

Outputs under ``system.log_dir/server``: ``events.jsonl`` (register, push, update with the sample
indices it applied, worker_failed, work_reassigned, eval, checkpoint, ...) and TensorBoard scalars;
checkpoints in ``system.checkpoint_dir`` every ``training.checkpoint_interval`` versions (written
before the next update, so a server killed at any moment loses fewer than that many versions; a failed
write ends the run with an error) and ``parameter_server_final.pt``.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import grpc
import torch
from torch import nn

from src import netem
from src import parameter_server_pb2 as pb
from src.aggregation import Contribution, ModelState, RequestLog, SyncRound
from src.checkpoint import (
    KEEP_CHECKPOINTS, CheckpointError, check_model_matches, final_checkpoint_path, load_latest_good, make_checkpoint, numbered_path, prune_checkpoints, save_checkpoint,
)
from src.compression import decompress, parse_header
from src.config import Config, SetupError
from src.controller import CompressionController
from src.coordinator import Batch, Member, Membership, MembershipError, WorkPlan
from src.data import load_dataset
from src.downlink import Downlink, compressor_from_config
from src.faults import FaultInjector
from src.metrics import MetricsLogger, TimeToTarget, read_events, write_summary
from src.ps_transport import Outgoing, Received, check_float32_bytes, require_auth_token, serialize, split, start_grpc_server, tensor_view
from src.served_model import layout_mismatch, model_from_layout
from src.staleness import StalenessPolicy, server_optimizer
from src.trainer import evaluate, model_from_config


MODELLESS_MAX_MESSAGE_BYTES = 1 << 30
"""Message limit of a server that starts without a model (it cannot size the limit from the model)."""
WAIT_POLL_S = 0.5  # a waiting call wakes this often to notice a cancelled RPC
MONITOR_PERIOD_S = 0.2  # failure detection runs this often: detection lands within timeout + this
_MEMBERSHIP_CODES = {
    "unknown": grpc.StatusCode.NOT_FOUND,  # register again
    "revoked": grpc.StatusCode.ABORTED,  # this incarnation is over
    "finished": grpc.StatusCode.FAILED_PRECONDITION,
}


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


class RunFailed(RuntimeError):
    """A background checkpoint or evaluation failed: the run stops with this error."""


def _spec(name: str, tensor: torch.Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, shape=list(tensor.shape))


def _work_message(batches: list[Batch] | None, finished: bool) -> pb.Work:
    """New batches to train on; none and not finished means: push what error feedback carries."""
    return pb.Work(finished=finished, flush=not finished and not batches,
                   batches=[pb.Batch(batch_id=b.batch_id, epoch=b.epoch, indices=b.indices) for b in batches or ()])


class ParameterServer:
    """The gRPC service (:func:`~src.ps_transport.service_handler`) and the run state behind it.

    Args:
        config: the run's config (mode, workers, optimizer, heartbeats, outputs).
        token: the auth token every RPC must carry (default: :func:`require_auth_token`).
        model: a model to serve instead of ``model_from_config(config)`` (benchmarks); see also
            :meth:`_served_model`.
        num_train_samples: training-set size (default: loaded from the config's dataset).
        staleness_policy: async weight-or-reject policy (default ``StalenessPolicy.from_config(config.system)``).
        evaluate: evaluate on the test split (every ``eval_interval`` versions, at epoch ends, at the end).
        tensorboard: also write TensorBoard scalars next to ``events.jsonl``.
        resume: a checkpoint file or folder of an earlier server of this run to continue from.
        faults: fire the config's ``kill:server@version=N`` faults (``False`` in a restarted server).
        on_event: called (outside the lock) with ``(kind, fields)`` for events a launcher acts on
            (``worker_failed``).
        clock: monotonic seconds, for heartbeats (tests inject one).

    Use: :meth:`start` -> workers train -> :meth:`wait_until_done` -> :meth:`finalize` -> :meth:`stop`.
    """

    def __init__(
        self,
        config: Config,
        *,
        token: str | None = None,
        model: nn.Module | None = None,
        num_train_samples: int | None = None,
        staleness_policy: StalenessPolicy | None = None,
        evaluate: bool = True,
        tensorboard: bool = True,
        resume: str | Path | None = None,
        faults: bool = True,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        t, system = config.training, config.system
        self.token = token or require_auth_token(system)
        self.mode = system.aggregation_mode
        self.num_workers = system.num_workers
        self.staleness_policy = staleness_policy or StalenessPolicy.from_config(system)
        # Adaptive compression (src/controller.py): fed this server's push and eval events; its decisions
        # go to the workers in every reply's Control and set the staleness policy's S_max.
        self.controller = CompressionController.from_config(system) if system.adaptive_compression else None
        if self.controller is not None and evaluate and not t.eval_interval:
            raise SetupError("system.adaptive_compression decides at evaluations: set training.eval_interval "
                             "(server versions between evaluations)")
        self._control = pb.Control()
        if self.controller is not None:
            self._set_control(self.controller.rho, self.controller.max_staleness)
        self.on_event = on_event
        netem.check_workers(config.emulation, self.num_workers)
        self.downlinks = {k: netem.link_or_none(netem.conditions_for(config.emulation, k).downlink)
                          for k in range(self.num_workers)}  # emulated server -> worker links
        self.model_label = t.model_architecture  # what checkpoints call the model
        self.data_label = t.dataset  # what summaries call the data
        self._grpc_server: grpc.Server | None = None
        self.test_set = None
        if evaluate:
            self.test_set = load_dataset(t.dataset, "test", data_dir=t.data_dir, max_samples=t.max_test_samples,
                                         num_samples=t.num_samples, seed=t.seed)
        self.state: ModelState | None = None
        self.param_specs: list[pb.TensorSpec] = []
        self.buffer_specs: list[pb.TensorSpec] = []
        self.downlink = Downlink([], None, refresh_interval=1, drift_bound=1.0)  # replaced with the model
        self.max_message_bytes = MODELLESS_MAX_MESSAGE_BYTES
        served = self._served_model(model)
        if served is not None:
            self._install_model(served)
        else:  # the first optimizer of a process costs seconds (lazy imports): not later, under the lock
            server_optimizer(config, [nn.Parameter(torch.zeros(1))])
        if num_train_samples is None:
            num_train_samples = len(load_dataset(t.dataset, "train", data_dir=t.data_dir, max_samples=t.max_train_samples,
                                                 num_samples=t.num_samples, seed=t.seed))
        self.num_train_samples = num_train_samples

        self._cond = threading.Condition()
        self.members = Membership(self.num_workers, system.heartbeat_timeout, clock=clock)
        self.plan = WorkPlan(num_train_samples, self.num_workers, t.batch_size, t.num_epochs, t.seed, self.mode,
                             batches_per_step=system.local_steps)
        self.requests = RequestLog()
        self._round: SyncRound | None = None
        self._started = self.mode == "async"  # sync waits for every worker before its first round
        self._to_deliver: dict[int, list[Batch]] = {}  # work handed out, not yet in a reply
        self._stopping = False
        self._fatal: BaseException | None = None
        self._done = threading.Event()
        self.counters = Counter()  # pushes_applied / _rejected / _refused, samples_applied, workers_failed, ...
        self.staleness_histogram: Counter[int] = Counter()
        self.controller_decisions: Counter[str] = Counter()  # by action: hold / compress_less / compress_more
        self._ledger: list[torch.Tensor] | None = None  # system.gradient_ledger: sum of the applied gradients (float64)
        self.stats_by_incarnation: dict[int, dict[str, Any]] = {}
        self._run_started_wall = time.time()
        self._train_started_wall: float | None = None
        self._train_ended_wall: float | None = None
        self.target = TimeToTarget(t.target_accuracy)
        self._faults = FaultInjector(system.inject_faults, "server", enabled=faults)

        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-background")  # evaluations
        self.log = MetricsLogger(Path(system.log_dir) / "server", tensorboard=tensorboard, role="server")
        self.resumed_from: Path | None = None
        if resume is not None:
            self._restore(resume)
        self.log.event("run_start", architecture="parameter_server", config=config.to_dict(),
                       resumed_from=str(self.resumed_from) if self.resumed_from else None, version=self.version)
        self._monitor: threading.Thread | None = None
        self.port: int | None = None

    def _served_model(self, model: nn.Module | None) -> nn.Module | None:
        """The model to serve from the start; ``None``: the first worker's Initialize brings it."""
        return model if model is not None else model_from_config(self.config)

    def _install_model(self, model: nn.Module) -> None:
        """Serve ``model``: its optimizer, specs, downlink and byte views (at construction, or lock held)."""
        system = self.config.system
        self.state = ModelState(model, server_optimizer(self.config, model.parameters()))
        self.param_specs = [_spec(n, p) for n, p in zip(self.state.param_names, self.state.params)]
        self.buffer_specs = [_spec(n, b) for n, b in zip(self.state.buffer_names, self.state.buffers)]
        self._param_shapes = [tuple(p.shape) for p in self.state.params]
        self._buffer_shapes = [tuple(b.shape) for b in self.state.buffers]
        self.downlink = Downlink(self.state.sent(), compressor_from_config(system),
                                 refresh_interval=system.downlink_refresh_interval, drift_bound=system.downlink_drift_bound)
        # Byte views of what workers are sent, made once: the tensors are updated in place.
        self._param_views = [tensor_view(p) for p in self.state.sent()]
        self._buffer_views = [tensor_view(b) for b in self.state.buffers]
        if self._grpc_server is None:  # the limit is fixed once serving
            model_bytes = 4 * sum(p.numel() for p in self.state.params + self.state.buffers)
            # A push is at most ~2x the model (top-k at ratio 1 sends value + index per entry).
            self.max_message_bytes = min(3 * model_bytes + (4 << 20), 2**31 - 1)
        if self.test_set is not None:
            self._eval_model = copy.deepcopy(model)

    @property
    def version(self) -> int:
        """The Server Version: optimizer steps taken (0 while there is no model yet)."""
        return self.state.version if self.state is not None else 0

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> int:
        """Serve on ``system.server_address`` and start failure detection; returns the bound port."""
        self._grpc_server, self.port = start_grpc_server(
            self, self.config.system, token=self.token, max_message_bytes=self.max_message_bytes,
            max_threads=3 * self.num_workers + 8,  # per worker: a waiting push, a heartbeat, a spare
        )
        self._monitor = threading.Thread(target=self._watch_heartbeats, name="ps-heartbeat-monitor", daemon=True)
        self._monitor.start()
        self.log.event("listening", address=self.config.system.server_address, port=self.port)
        return self.port

    def wait_until_done(self, timeout: float | None = None) -> bool:
        """Block until the run is over: every batch applied and every live worker finished (or ``timeout``).

        Raises:
            RunFailed: a background checkpoint or evaluation failed.
        """
        finished = self._done.wait(timeout)
        if self._fatal is not None:
            raise RunFailed(str(self._fatal)) from self._fatal
        return finished

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving: waiting calls return, then the gRPC server shuts down."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._grpc_server is not None:
            self._grpc_server.stop(grace).wait()
        if self._monitor is not None:
            self._monitor.join(5)
        self._background.shutdown(wait=True)
        self.log.close()

    # ------------------------------------------------------------------------- RPCs

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        worker_id = request.worker_id
        with self._cond:
            if request.any_worker_id:
                worker_id = self._free_worker_id(context)
            try:
                member, replaced = self.members.register(worker_id, request.pid)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            # Every incarnation is in the summary's workers, also one killed before its first heartbeat.
            self._record_stats(member, pb.WorkerStats(), final=False)
            events = []
            if replaced is not None:
                events += self._fail(replaced, reason="replaced by a new incarnation", silence=None)
            self.downlink.forget(worker_id)
            applied = bool(request.last_request_id) and self.requests.was_applied(worker_id, request.last_request_id)
            unknown = self.plan.claim(worker_id, request.carried_batch_ids) if not applied else []
            version = self.version
            self._cond.notify_all()
        rejoined = any(m.worker_id == worker_id for m in self.members.history[:-1])
        self.log.event("worker_rejoined" if rejoined else "register", worker=worker_id, incarnation=member.incarnation,
                       peer=context.peer(), version=version, last_request_applied=applied,
                       carried_batches=list(request.carried_batch_ids), carried_unknown=unknown)
        self._publish(events)
        return pb.RegisterReply(
            worker_id=worker_id, incarnation=member.incarnation, session=member.session, version=version,
            run_config_json=self.config.model_dump_json(),
            parameter_specs=self.param_specs, buffer_specs=self.buffer_specs, last_request_applied=applied,
            model_wanted=self.state is None,
        )

    def Initialize(self, data: bytes, context: grpc.ServicerContext) -> pb.InitializeReply:
        try:
            received = split(data, pb.InitializeRequest, ("parameters", "buffers"))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"initialize: {exc}")
        request = received.message
        layout = ([(s.name, tuple(s.shape)) for s in request.parameter_specs],
                  [(s.name, tuple(s.shape)) for s in request.buffer_specs])
        with self._cond:
            member = self._member(request.caller, context)
            if self.state is not None:  # another worker's model came first, or the server has its own
                mismatch = layout_mismatch(layout, (self.state.param_names, self._param_shapes),
                                           (self.state.buffer_names, self._buffer_shapes))
                if mismatch:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"worker {member.worker_id}: its model does not match the server's: {mismatch}")
                return pb.InitializeReply(accepted=False, version=self.state.version)
            try:
                model = model_from_layout(*layout, received.large["parameters"], received.large["buffers"])
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"initialize: {exc}")
            self._install_model(model)
            self._cond.notify_all()
        self.log.event("model_initialized", worker=member.worker_id, incarnation=member.incarnation,
                       parameters=len(layout[0]), buffers=len(layout[1]),
                       numel=sum(p.numel() for p in self.state.params))
        return pb.InitializeReply(accepted=True, version=0)

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes:
        with self._cond:
            member = self._member(request.caller, context)
            self._require_model(context)
            if not member.ready:
                member.ready = True
                self._maybe_start()
            batches, finished = self._await_work(member, context)
            self.downlink.forget(member.worker_id)  # a pull starts the worker afresh: dense parameters
            message = pb.PullReply(version=self.state.version, work=self._work_message(batches, finished), control=self._control)
            reply = self._reply_bytes(message, member.worker_id)
        self._emulate_downlink(member.worker_id, reply)
        return reply

    def Push(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            received = split(data, pb.PushRequest, ("gradients", "buffers"))
        except ValueError as exc:
            self._refused(None, 0, PushRefused(grpc.StatusCode.INVALID_ARGUMENT, f"push: {exc}"), context)
        request = received.message
        worker_id, request_id = request.caller.worker_id, request.request_id
        try:
            with self._cond:
                member = self._member(request.caller, context)
                self._require_model(context)
                if request_id == 0:
                    raise PushRefused(grpc.StatusCode.INVALID_ARGUMENT, "push: request_id must be non-zero (unique per push)")
                while self.requests.lookup(worker_id, request_id) is RequestLog.IN_PROGRESS:
                    self._cond.wait(WAIT_POLL_S)  # the first copy of this request is still being handled
                    self._member(request.caller, context)
                remembered = self.requests.lookup(worker_id, request_id)
                if remembered is not None:
                    return remembered  # a retry: answer again, apply nothing
                self._check_covers(request, self.plan.holding(worker_id))
                self.requests.begin(worker_id, request_id)
            try:
                contribution = self._decode(worker_id, received)  # outside the lock: workers decode in parallel
                with self._cond:
                    member = self._member(request.caller, context)
                    verdict = (self._add_to_round if self.mode == "sync" else self._apply_now)(member, request, contribution)
                    self._cond.notify_all()
                    batches, finished = self._await_work(member, context)
                    verdict.work.CopyFrom(self._work_message(batches, finished))
                    verdict.version = self.state.version
                    verdict.control.CopyFrom(self._control)
                    reply = self._reply_bytes(verdict, worker_id)
                    self.requests.finish(worker_id, request_id, reply, applied=verdict.accepted)
                    self._cond.notify_all()
                self._emulate_downlink(worker_id, reply)
                return reply
            except BaseException:
                with self._cond:
                    if self.requests.lookup(worker_id, request_id) is RequestLog.IN_PROGRESS:
                        self.requests.abandon(worker_id, request_id)
                    self._cond.notify_all()
                raise
        except PushRefused as refused:
            self._refused(worker_id, request_id, refused, context)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        with self._cond:
            member = self._member(request.caller, context)
            self._record_stats(member, request.stats, final=False)
            return pb.HeartbeatReply(version=self.version)

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        with self._cond:
            member = self._member(request.caller, context)
            if not self.plan.finished():
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {member.worker_id}: the run is not finished (epochs done {self.plan.epochs_done()}"
                              f"/{self.config.training.num_epochs})")
            stats = self._record_stats(member, request.stats, final=True)
            self.members.finish(member)
            self.state.forget_worker(member.worker_id)
            self._check_done()
            version = self.version
        self.log.event("worker_finished", worker=member.worker_id, incarnation=member.incarnation, version=version, **stats)
        return pb.FinishReply(version=version)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        with self._cond:
            current = self.members.current
            return pb.StatusReply(
                version=self.version, aggregation_mode=self.mode, num_workers=self.num_workers,
                registered=sorted(current), finished=sorted(w for w, m in current.items() if m.state == "finished"),
                pushes_applied=self.counters["pushes_applied"], pushes_rejected=self.counters["pushes_rejected"],
                pushes_refused=self.counters["pushes_refused"], done=self._done.is_set(),
                workers=[pb.WorkerState(worker_id=m.worker_id, incarnation=m.incarnation, state=m.state) for m in self.members.history],
                epochs_done=self.plan.epochs_done(),
            )

    # ------------------------------------------------------------------------- calls: checks and waits

    def _member(self, caller: pb.Caller, context: grpc.ServicerContext) -> Member:
        """The live member behind ``caller`` (lock held); aborts the call otherwise."""
        try:
            return self.members.check(caller.worker_id, caller.session)
        except MembershipError as exc:
            context.abort(_MEMBERSHIP_CODES[exc.kind], exc.message)

    def _require_model(self, context: grpc.ServicerContext) -> None:
        """Abort the call (lock held) while the server has no model yet."""
        if self.state is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the server has no model yet: send Initialize first")

    def _free_worker_id(self, context: grpc.ServicerContext) -> int:
        """The lowest worker id no live incarnation holds (lock held); aborts when all are held."""
        live = set(self.members.live())
        free = [w for w in range(self.num_workers) if w not in live]
        if not free:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"all {self.num_workers} worker ids are held by live workers (system.num_workers)")
        return free[0]

    def _refused(self, worker_id: int | None, request_id: int, refused: PushRefused, context: grpc.ServicerContext) -> None:
        with self._cond:
            self.counters["pushes_refused"] += 1
        self.log.event("push_refused", worker=worker_id, request_id=request_id, code=refused.code.name, reason=refused.message)
        context.abort(refused.code, refused.message)

    def _await_work(self, member: Member, context: grpc.ServicerContext) -> tuple[list[Batch] | None, bool]:
        """Wait (lock held) until ``member`` has work to be told about, or the run is finished."""
        worker = member.worker_id
        while True:
            self._check_waiting(member, context)
            if worker in self._to_deliver:
                return self._to_deliver.pop(worker), False
            if self.mode == "async":
                batches = self.plan.next_for(worker, self.members.live())
                if batches:
                    self._training_clock_starts()
                    return batches, False
                if self.plan.holding(worker):
                    return [], False  # only carried (rejected) batches: flush them
            if self.plan.finished():
                return None, True
            if self._stopping:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the parameter server is shutting down")
            self._cond.wait(WAIT_POLL_S)
            if not context.is_active():
                context.abort(grpc.StatusCode.CANCELLED, "call cancelled while waiting for work")

    def _check_waiting(self, member: Member, context: grpc.ServicerContext) -> None:
        """Abort a waiting call (lock held) whose member is no longer live, or when the run failed."""
        try:
            self.members.verify(member)  # not a sign of life: a hung process's open call must not keep it alive
        except MembershipError as exc:
            context.abort(_MEMBERSHIP_CODES[exc.kind], exc.message)
        if self._fatal is not None:
            context.abort(grpc.StatusCode.INTERNAL, f"the server stopped the run: {self._fatal}")

    def _work_message(self, batches: list[Batch] | None, finished: bool) -> pb.Work:
        return _work_message(batches, finished)

    def _check_covers(self, request: pb.PushRequest, held: list[Batch]) -> None:
        worker = request.caller.worker_id
        expected = sorted(b.batch_id for b in held)
        if not held:
            raise PushRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"push from worker {worker}, which holds no work (pushes only answer work handed out)")
        if sorted(request.batch_ids) != expected:
            raise PushRefused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"push from worker {worker} covers batches {sorted(request.batch_ids)}, but it holds {expected}")
        samples = sum(len(b.indices) for b in held)
        if request.num_samples != samples:
            raise PushRefused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"push from worker {worker}: num_samples {request.num_samples}, but its batches hold {samples} samples")

    def _decode(self, worker_id: int, received: Received) -> Contribution:
        """Check and decompress a push's tensors; raises :class:`PushRefused` (INVALID_ARGUMENT) naming the problem."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        request, payloads, raw_buffers = received.message, received.large["gradients"], received.large["buffers"]
        if len(payloads) != len(self.state.params):
            raise PushRefused(invalid, f"push carries {len(payloads)} gradients, the model has {len(self.state.params)} parameters")
        gradients = []
        for index, (payload, spec, shape) in enumerate(zip(payloads, self.param_specs, self._param_shapes)):
            try:
                header = parse_header(payload)  # before decompressing: the header bounds the allocation
                if header.shape != shape:
                    raise ValueError(f"shape {list(header.shape)}, expected {list(shape)}")
                # copy=False: identity gradients stay read-only views of the message (nothing writes them)
                gradients.append(decompress(payload, copy=False))  # refuses malformed buffers and NaN/Inf
            except ValueError as exc:
                raise PushRefused(invalid, f"gradient {index} ({spec.name}): {exc}") from None
        buffers = []
        if raw_buffers:
            if len(raw_buffers) != len(self.state.buffers):
                raise PushRefused(invalid, f"push carries {len(raw_buffers)} buffers, the model has {len(self.state.buffers)}")
            for data, spec, shape in zip(raw_buffers, self.buffer_specs, self._buffer_shapes):
                try:
                    check_float32_bytes(data, math.prod(shape), f"buffer {spec.name}")
                except ValueError as exc:
                    raise PushRefused(invalid, str(exc)) from None
                values = torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
                if not bool(torch.isfinite(values).all()):
                    raise PushRefused(invalid, f"buffer {spec.name}: holds NaN or Inf values")
                buffers.append(values)
        return Contribution(worker_id, request.num_samples, gradients, buffers, request.request_id)

    # ------------------------------------------------------------------------- aggregation (lock held)

    def _add_to_round(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> pb.PushReply:
        round_ = self._round
        if round_ is None or request.base_version != round_.version:
            raise PushRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"sync push for version {request.base_version}, but the barrier is at version "
                              f"{round_.version if round_ else self.state.version}")
        try:
            round_.add(contribution)
        except ValueError as exc:
            raise PushRefused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        self.staleness_histogram[0] += 1  # a sync push is always for the current version
        self._log_push(member, request, staleness=0, weight=1.0, accepted=True)
        self._maybe_complete_round()
        return pb.PushReply(accepted=True, staleness=0, weight=1.0)

    def _maybe_complete_round(self) -> None:
        """Apply the round if every expected worker is in; open the next one when none is open."""
        round_ = self._round
        if round_ is not None and round_.complete():
            contributions = round_.contributions()
            gradients, buffers = self.state.average(contributions)
            self.state.step(gradients, buffers)
            self._round = None
            self._applied(contributions)
        if self._round is None or not self._round.expected:
            self._round = None
            self._open_round()

    def _open_round(self) -> None:
        """sync: hand every ready worker its next batch for the current version (lock held)."""
        if not self._started or self._round is not None:
            return
        handed = self.plan.start_round(self.members.ready(), self.members.live())
        if handed:
            self._round = SyncRound(self.state.version, set(handed))
            self._to_deliver.update(handed)
            self._training_clock_starts()
        self._check_done()

    def _apply_now(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> pb.PushReply:
        if request.base_version > self.state.version:
            raise PushRefused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"base_version {request.base_version} is ahead of the server's version {self.state.version}")
        staleness = self.state.version - request.base_version
        self.staleness_histogram[staleness] += 1
        weight, reason = self.staleness_policy.verdict(staleness)
        self._log_push(member, request, staleness=staleness, weight=weight, accepted=weight is not None, reason=reason)
        if weight is None:
            self.counters["pushes_rejected"] += 1
            return pb.PushReply(accepted=False, staleness=staleness, weight=0.0,
                                reason=f"rejected by the staleness policy: {reason}")
        self.state.step(contribution.gradients, contribution.buffers, weight, worker=member.worker_id)
        self._applied([contribution])
        return pb.PushReply(accepted=True, staleness=staleness, weight=weight)

    def _applied(self, contributions: list[Contribution]) -> None:
        """The update just stepped holds everything its contributors held: bookkeeping, events, checkpoints (lock held)."""
        samples, epochs_done = [], []
        for contribution in contributions:
            self.requests.mark(contribution.worker, contribution.request_id, applied=True)  # before a checkpoint below
            if self.config.system.gradient_ledger:
                self._add_to_ledger(contribution.gradients)
            batches, finished_epochs = self.plan.applied(contribution.worker)
            samples += [[b.epoch, list(b.indices)] for b in batches]
            epochs_done += finished_epochs
            self.counters["samples_applied"] += contribution.num_samples  # checked to equal its batches' samples
        self.counters["pushes_applied"] += len(contributions)
        version = self.state.version
        self.log.event("update", version=version, requests=[[c.worker, c.request_id] for c in contributions],
                       samples=samples, num_samples=sum(c.num_samples for c in contributions))
        self._after_version(epochs_done)
        self._faults.reached(version, announce=lambda fault: self.log.event("fault_injected", fault=str(fault), version=version))
        if self.plan.finished() and self._train_ended_wall is None:
            self._train_ended_wall = time.time()
        self._check_done()

    def _add_to_ledger(self, gradients: list[torch.Tensor]) -> None:
        if self._ledger is None:
            self._ledger = [torch.zeros(g.shape, dtype=torch.float64) for g in gradients]
        for total, gradient in zip(self._ledger, gradients):
            total.add_(gradient.to(torch.float64))

    def _log_push(self, member: Member, request: pb.PushRequest, *, staleness: int, weight: float | None, accepted: bool,
                  reason: str | None = None) -> None:
        """The push event: its Staleness, weight and verdict (with the policy's reason), batches and timings."""
        metrics = request.metrics
        event = self.log.event("push", worker=member.worker_id, incarnation=member.incarnation, request_id=request.request_id,
                       base_version=request.base_version, version=self.state.version, staleness=staleness, weight=weight,
                       accepted=accepted, reason=reason, num_samples=request.num_samples, batch_ids=list(request.batch_ids),
                       epoch=metrics.epoch, loss=metrics.loss, gradient_time_s=metrics.gradient_time_s,
                       compression_time_s=metrics.compression_time_s, communication_time_s=metrics.communication_time_s)
        if self.controller is not None:
            self.controller.observe(event)  # timings only; decisions come at evaluations

    # ------------------------------------------------------------------------- membership (lock held)

    def _maybe_start(self) -> None:
        """sync: the first round starts once every worker id has registered and every live one is ready."""
        ready = self.members.ready()
        if not self._started and ready and len(self.members.current) == self.num_workers and ready == self.members.live():
            self._started = True
        if self._started and self.mode == "sync":
            self._open_round()

    def _training_clock_starts(self) -> None:
        if self._train_started_wall is None:
            self._train_started_wall = time.time()

    def _fail(self, member: Member, *, reason: str, silence: float | None) -> list:
        """``member`` is gone: leave the barrier, hand its work to the live workers. Returns events to publish."""
        self.members.fail(member)
        worker = member.worker_id
        self.counters["workers_failed"] += 1
        self._to_deliver.pop(worker, None)
        self.state.forget_worker(worker)
        if self._round is not None:
            self._round.drop(worker)
        moved = self.plan.release(worker, self.members.live())
        self.log.event("worker_failed", worker=worker, incarnation=member.incarnation, pid=member.pid, reason=reason,
                       silent_for_s=silence, version=self.version)
        if moved:
            self.log.event("work_reassigned", worker=worker, version=self.version,
                           batches={str(to): [b.batch_id for b in bs] for to, bs in moved.items()},
                           samples=sum(len(b.indices) for bs in moved.values() for b in bs))
        if self.mode == "sync":
            self._maybe_start()
            self._maybe_complete_round()
        self._check_done()
        self._cond.notify_all()
        return [("worker_failed", {"worker": worker, "incarnation": member.incarnation, "pid": member.pid})]

    def _watch_heartbeats(self) -> None:
        while True:
            with self._cond:
                if self._stopping or self._done.is_set():
                    return
                events = []
                for member, silence in self.members.expire():
                    events += self._fail(member, reason=f"silent for {silence:.2f} s", silence=silence)
            self._publish(events)
            time.sleep(MONITOR_PERIOD_S)

    def _publish(self, events: list) -> None:
        """Tell the launcher (outside the lock) about events it acts on."""
        if self.on_event is not None:
            for kind, fields in events:
                self.on_event(kind, fields)

    def _record_stats(self, member: Member, stats: pb.WorkerStats, *, final: bool) -> dict[str, Any]:
        values = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
        self.stats_by_incarnation[member.incarnation] = {"worker_id": member.worker_id, "incarnation": member.incarnation,
                                                         "final": final, **values}
        return values

    def _check_done(self) -> None:
        """The run is over when every batch is applied and no live worker is left to finish."""
        if self.plan.finished() and not self.members.live():
            self._done.set()
            self._cond.notify_all()

    # ------------------------------------------------------------------------- replies

    def _emulate_downlink(self, worker: int, reply: bytes) -> None:
        """Wait as long as ``reply`` takes on ``worker``'s emulated downlink (lock not held: links are parallel)."""
        link = self.downlinks.get(worker)
        if link is not None:
            link.transmit(len(reply))

    def _reply_bytes(self, message, worker: int) -> bytes:
        """``message`` with the current parameters (dense, or a delta for ``worker``) and buffers, serialized.

        Lock held: every tensor is of one version.
        """
        self.state.sent()  # the lookahead point of this version, when workers are sent one
        downlink = self.downlink.encode(worker, self.state.version)
        tensors = {"parameters": self._param_views} if downlink.dense else {"parameter_deltas": downlink.payloads}
        return serialize(Outgoing(message, {**tensors, "buffers": self._buffer_views}))

    # ------------------------------------------------------------------------- evaluation, checkpoints

    def _after_version(self, epochs_done: list[int]) -> None:
        version = self.state.version
        t = self.config.training
        if version % t.checkpoint_interval == 0:
            # Written before any further update (lock held): a server killed at any moment loses fewer than
            # checkpoint_interval versions. A background write could be overtaken by the next checkpoint.
            self._write_numbered_checkpoint(version, self._checkpoint_state())
        evaluate_now = bool(epochs_done) and epochs_done[-1] + 1 < t.num_epochs  # the final evaluation covers the last
        if t.eval_interval and version % t.eval_interval == 0:
            evaluate_now = True
        if self.test_set is not None and evaluate_now:
            epoch = self.plan.epochs_done()
            self._submit(self._evaluate_snapshot, epoch, version, self.state.snapshot(), self._elapsed())

    def _submit(self, function, *args) -> None:
        self._background.submit(function, *args).add_done_callback(self._background_done)

    def _background_done(self, future: Future) -> None:
        error = future.exception()
        if error is not None and self._fatal is None:
            self._fatal = error
            self._done.set()
            with self._cond:
                self._cond.notify_all()

    def _elapsed(self) -> float:
        return time.time() - self._train_started_wall if self._train_started_wall is not None else 0.0

    def _checkpoint_state(self) -> dict[str, Any]:
        """Everything a resumed server needs, copied under the lock."""
        return {
            "model": self.state.snapshot(),
            "optimizer": copy.deepcopy(self.state.optimizer.state_dict()),
            "version": self.state.version,
            "epochs_done": self.plan.epochs_done(),
            "extra": {
                "version": self.state.version,
                "aggregation_mode": self.mode,
                "num_workers": self.num_workers,
                "work": self.plan.state_dict(),
                "requests": self.requests.state_dict(),
                "next_incarnation": self.members.next_incarnation,
                "counters": dict(self.counters),
                "staleness_histogram": {str(k): v for k, v in self.staleness_histogram.items()},
                "controller": None if self.controller is None else {
                    "state": self.controller.state_dict(), "decisions": dict(self.controller_decisions)},
                "stats_by_incarnation": {str(k): dict(v) for k, v in self.stats_by_incarnation.items()},
                "run_started_wall": self._run_started_wall,
                "train_started_wall": self._train_started_wall,
                "time_to_target": [self.target.seconds, self.target.step],
                "layout": {"parameters": list(self.state.param_names), "buffers": list(self.state.buffer_names)},
            },
        }

    def _checkpoint(self, path: Path, state: dict[str, Any]) -> Path:
        checkpoint = make_checkpoint(
            model_state_dict=state["model"], optimizer_state_dict=state["optimizer"],
            model_architecture=self.model_label, dataset=self.data_label,
            epoch=state["epochs_done"], step=state["version"], config=self.config.to_dict(), extra=state["extra"],
        )
        return save_checkpoint(path, checkpoint)

    def _write_numbered_checkpoint(self, version: int, state: dict[str, Any]) -> None:
        """Write ``checkpoint_<version>.pt`` (lock held); a failure is an event and ends the run with an error."""
        try:
            directory = Path(self.config.system.checkpoint_dir)
            written = self._checkpoint(numbered_path(directory, version), state)
            prune_checkpoints(directory, KEEP_CHECKPOINTS)
            self.log.event("checkpoint", path=str(written), version=version)
        except Exception as exc:
            self.log.event("checkpoint_failed", version=version, error=f"{type(exc).__name__}: {exc}")
            self._fatal = RunFailed(f"checkpoint at version {version} failed: {type(exc).__name__}: {exc}")
            self._done.set()
            self._cond.notify_all()

    def _restore(self, target: str | Path) -> None:
        """Continue from a checkpoint of this run's server (strictly: it must be one)."""
        path, checkpoint = load_latest_good(target)
        extra = checkpoint["extra"]
        if "work" not in extra or extra.get("num_workers") != self.num_workers or extra.get("aggregation_mode") != self.mode:
            raise CheckpointError(f"--resume {path}: not a checkpoint of a {self.mode} parameter-server run with "
                             f"{self.num_workers} workers")
        check_model_matches(path, checkpoint, self.model_label)
        if self.state is None:  # a server that takes its model from a worker: the checkpoint holds it
            layout = extra.get("layout")
            if layout is None:
                raise CheckpointError(f"--resume {path}: the checkpoint does not record its model's layout")
            state = checkpoint["model_state_dict"]
            self._install_model(model_from_layout(
                [(n, tuple(state[n].shape)) for n in layout["parameters"]], [(n, tuple(state[n].shape)) for n in layout["buffers"]],
                [state[n] for n in layout["parameters"]], [state[n] for n in layout["buffers"]]))
        self.state.model.load_state_dict(checkpoint["model_state_dict"])
        self.state.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        self.state.version = extra["version"]
        self.plan.load_state_dict(extra["work"])
        self.requests.load_state_dict(extra["requests"])
        self.members.next_incarnation = extra["next_incarnation"]
        self.counters.update(extra["counters"])
        self.staleness_histogram.update({int(k): v for k, v in extra["staleness_histogram"].items()})
        if self.controller is not None and extra.get("controller"):
            self.controller.load_state_dict(extra["controller"]["state"])
            self.controller_decisions.update(extra["controller"]["decisions"])
            self._set_control(self.controller.rho, self.controller.max_staleness)
        self.stats_by_incarnation = {int(k): v for k, v in extra["stats_by_incarnation"].items()}
        self._run_started_wall = extra["run_started_wall"]
        self._train_started_wall = extra["train_started_wall"]
        self.target.seconds, self.target.step = extra["time_to_target"]
        self.resumed_from = path
        events_path = Path(self.config.system.log_dir) / "server" / "events.jsonl"
        reached = max((e["version"] for e in read_events(events_path, "update")), default=self.state.version) \
            if events_path.is_file() else self.state.version
        self.counters["server_recoveries"] += 1
        self.counters["versions_lost"] += max(0, reached - self.state.version)
        self.log.event("server_recovered", checkpoint=str(path), version=self.state.version,
                       versions_lost=max(0, reached - self.state.version))

    def _evaluate_snapshot(self, epoch: int, version: int, state: dict[str, torch.Tensor], elapsed: float) -> None:
        self._eval_model.load_state_dict(state)
        self._record_eval(epoch, version, self._eval_model, elapsed)

    def _record_eval(self, epoch: int, version: int, model: nn.Module, elapsed: float) -> tuple[float, float]:
        t = self.config.training
        loss, accuracy = evaluate(model, self.test_set, batch_size=t.eval_batch_size)
        event = self.log.scalars("eval", version, {"test_loss": loss, "test_accuracy": accuracy}, epoch=epoch, elapsed_s=elapsed)
        if self.controller is not None:
            with self._cond:
                self._decide(event)
        if self.target.observe(accuracy, elapsed, version):
            self.log.event("target_reached", version=version, elapsed_s=elapsed, accuracy=accuracy)
        print(f"epoch {epoch}/{t.num_epochs}: test accuracy {accuracy * 100:.2f}%, test loss {loss:.4f} (server version {version})", flush=True)
        return loss, accuracy

    def _decide(self, eval_event: dict[str, Any]) -> None:
        """The controller's decision at an evaluation: an event, and the Control of every later reply (lock held)."""
        decision = self.controller.observe(eval_event)
        if decision is None:
            return
        fields = {k: v for k, v in decision.items() if k != "kind"}
        self.log.event("controller", **fields)
        self.controller_decisions[decision["action"]] += 1
        self._set_control(decision["rho"], decision["max_staleness"])

    def _set_control(self, rho: float, max_staleness: int) -> None:
        """Workers use ``rho`` from their next step (top-k runs); pushes are judged against ``max_staleness`` now."""
        compresses_topk = self.config.system.compression_enabled and self.config.system.compression_type == "topk"
        self._control = pb.Control(compression_ratio=rho if compresses_topk else 0.0, max_staleness=max_staleness)
        self.staleness_policy = self.staleness_policy.with_max_staleness(max_staleness)

    def _emulation_summary(self) -> dict[str, Any] | None:
        """Which emulation was on (``None``: none) and the downlink delay each worker's replies waited."""
        described = netem.describe(self.config.emulation, self.num_workers)
        waited = {str(k): link.delay_s for k, link in self.downlinks.items() if link is not None}
        if described is not None and waited:
            described["downlink_delay_s"] = waited
        return described

    def finalize(self, summary_json: str | Path | None = None) -> dict[str, Any]:
        """After the run is over: final evaluation, final checkpoint, run summary (returned and written).

        Raises:
            RunFailed: a background checkpoint or evaluation failed.
        """
        self._background.submit(lambda: None).result()  # let a pending checkpoint or evaluation finish first
        if self._fatal is not None:
            raise RunFailed(str(self._fatal)) from self._fatal
        t = self.config.training
        with self._cond:
            state = self._checkpoint_state()
            workers = [self.stats_by_incarnation[i] for i in sorted(self.stats_by_incarnation)]
        version = state["version"]
        elapsed = self._elapsed() if self._train_ended_wall is None else self._train_ended_wall - (self._train_started_wall or 0.0)
        final_loss, final_accuracy = (self._record_eval(t.num_epochs, version, self.state.model, elapsed)
                                      if self.test_set is not None else (float("nan"), float("nan")))
        checkpoint_path = self._checkpoint(final_checkpoint_path(self.config.system.checkpoint_dir, "parameter_server"), state)
        if self.config.system.gradient_ledger:
            ledger = dict(zip(self.state.param_names, self._ledger or [torch.zeros(p.shape, dtype=torch.float64)
                                                                       for p in self.state.params]))
            torch.save({"applied": ledger}, Path(self.config.system.log_dir) / "server" / "gradient_ledger.pt")
        train_time = elapsed
        samples = self.counters["samples_applied"]
        histogram = dict(sorted(self.staleness_histogram.items()))
        judged = sum(histogram.values())
        summary = {
            "architecture": "parameter_server",
            "dataset": self.data_label,
            "num_workers": self.num_workers,
            "aggregation_mode": self.mode,
            "final_accuracy": final_accuracy,
            "final_loss": final_loss,
            "total_time_s": time.time() - self._run_started_wall,
            "train_time_s": train_time,
            "clock": "from the first work handed to a worker to the last update applied; includes server restarts",
            "throughput_samples_per_s": samples / train_time if train_time > 0 else 0.0,
            "samples_processed": samples,
            "samples_computed": sum(w["samples"] for w in workers),
            "bytes_sent": sum(w["bytes_sent"] for w in workers),
            "bytes_received": sum(w["bytes_received"] for w in workers),
            "compression": compression_label(self.config),
            "checkpoint_path": str(checkpoint_path),
            "epochs": t.num_epochs,
            "versions": version,
            "pushes_applied": self.counters["pushes_applied"],
            "pushes_rejected": self.counters["pushes_rejected"],
            "pushes_refused": self.counters["pushes_refused"],
            "staleness_histogram": {str(k): v for k, v in histogram.items()},
            "mean_staleness": sum(k * v for k, v in histogram.items()) / judged if judged else 0.0,
            "max_staleness": max(histogram, default=0),
            "controller": None if self.controller is None else {
                "decisions": dict(self.controller_decisions), "final_compression_ratio": self._control.compression_ratio or None,
                "final_max_staleness": self.controller.max_staleness},
            **self.target.fields(),
            "gradient_time_s": sum(w["gradient_time_s"] for w in workers),
            "compression_time_s": sum(w["compression_time_s"] for w in workers),
            "communication_time_s": sum(w["communication_time_s"] for w in workers),
            "faults": {
                "worker_failures": self.counters["workers_failed"],
                "server_recoveries": self.counters["server_recoveries"],
                "versions_lost": self.counters["versions_lost"],
            },
            "worker_incarnations": len(workers),
            "workers": workers,
            "emulation": self._emulation_summary(),
        }
        self.log.event("run_end", **{k: v for k, v in summary.items() if k != "workers"})
        write_summary(summary_json or Path(self.config.system.log_dir) / "summary.json", summary)
        return summary
