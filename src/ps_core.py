"""The parameter server's logic, with no transport in it: the one implementation every driver runs.

Drivers: the gRPC service (:mod:`src.parameter_server`), the library's server for client-owned work
(:mod:`src.torch_asgc.server`) and the virtual-time simulation (:mod:`src.virtual_time`). They move
bytes and decide *when* things happen; everything the server *decides* is here, so a simulation and
a real server cannot disagree.

A run has ``system.num_workers`` worker ids. A worker registers (a new incarnation, with a session
secret every later call must carry), pulls the parameters and its first work, then loops: train on
the work it was handed -> push the gradient -> the reply carries the verdict, the parameters to
train on next and the next work (one call per step). Where work comes from is the
:class:`~src.work_source.WorkSource`: the dataset's plan, or the workers' own loops.

* **sync**: one barrier per version among the workers handed work for it (:class:`src.aggregation.SyncRound`);
  the sample-weighted mean of their gradients is one optimizer step. The first round starts when
  all ``num_workers`` workers are ready.
* **async**: each push is judged by the staleness policy (weight, or reject: the worker then rolls
  its error feedback back and the push's batches stay with it) and applied at once.

Learning rate: the update that makes version ``v + 1`` steps at ``training.lr_schedule``'s rate for
``v`` (:mod:`src.lr_schedule`; a resumed server continues it), unless its pushes carry the rate of
the worker's own scheduler (``PushRequest.learning_rate``, the library's DistributedOptimizer): then
that one (the mean over a sync round's pushes), and a warning says the server's schedule is not
applied when it has one.

Failures: a worker silent for ``system.heartbeat_timeout`` (:meth:`ServerCore.expire`), or replaced
by a new incarnation, is failed: it leaves the sync barrier with its not-yet-applied contribution,
and the work it held goes to the live workers. Calls from a failed incarnation are refused. With
``resume``, the core continues from its own checkpoint (parameters, optimizer, version, work
progress, de-dup outcomes, totals, controller).

How a driver calls it. Every method that reads or changes the run is called with :attr:`ServerCore.lock`
held, except :meth:`ServerCore.decode` (only reads the model's layout: pushes decode in parallel).
Nothing here waits: :meth:`ServerCore.poll_work` says whether a waiting call's work is there yet
(``None``: not yet), and a driver waits in its own way (a gRPC handler thread on :attr:`lock`, the
simulation by re-polling after each event). Refusals are :class:`Refused` with a status code named
like gRPC's (``INVALID_ARGUMENT``, ``ABORTED``, ...), which each transport maps to its own errors.
Time comes from the injected :class:`~src.clock.Clock`; evaluations run on the injected executor
(a background thread for real servers, inline in a simulation); injected faults call ``fire_fault``.
Pull and Push replies are ``bytes`` joined under the lock, or (``reply_views``, the real servers)
:class:`~src.wire.Pieces` over the parameters' own memory that the transport sends or joins outside
the lock, copied only if the next step comes while a reply is still being sent
(:class:`~src.wire.SharedBuffers`); a retried push is then answered with its verdict and work and,
when the model moved on without keeping the first reply's bytes, the newest parameters.

Outputs under ``system.log_dir/server``: ``events.jsonl`` (register, push, update with the sample
indices it applied, worker_failed, work_reassigned, eval, checkpoint, ...) and TensorBoard scalars;
checkpoints in ``system.checkpoint_dir`` every ``training.checkpoint_interval`` versions (written
before the next update, so a server killed at any moment loses fewer than that many versions; a
failed write ends the run with an error) and ``parameter_server_final.pt``.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from collections import Counter
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from src import netem, tracing
from src import parameter_server_pb2 as pb
from src.aggregation import Contribution, ModelState, RequestLog, SyncRound
from src.checkpoint import (
    KEEP_CHECKPOINTS,
    CheckpointError,
    check_model_matches,
    final_checkpoint_path,
    load_latest_good,
    make_checkpoint,
    numbered_path,
    prune_checkpoints,
    save_checkpoint,
)
from src.clock import REAL_CLOCK, Clock
from src.compression import decompress, parse_header
from src.config import Config, SetupError
from src.controller import CompressionController
from src.coordinator import Batch, Member, Membership, MembershipError
from src.downlink import Downlink, compressor_from_config
from src.exposed_comm import exposed_communication
from src.faults import FaultInjector, FaultSpec
from src.lr_schedule import is_constant, scheduled_learning_rate
from src.metrics import MetricsLogger, TimeToTarget, read_events, write_summary
from src.served_model import layout_mismatch, model_from_layout
from src.staleness import StalenessPolicy, server_optimizer
from src.trackers import open_trackers
from src.trainer import evaluate, samples_due
from src.wire import (
    Outgoing,
    Pieces,
    Received,
    SharedBuffers,
    check_float32_bytes,
    encode,
    serialize,
    split,
    tensor_view,
)
from src.work_source import WorkRefused, WorkSource

logger = logging.getLogger(__name__)

MODELLESS_MAX_MESSAGE_BYTES = 1 << 30
"""Message limit of a server that starts without a model (it cannot size the limit from the model)."""
MEMBERSHIP_CODES = {"unknown": "NOT_FOUND", "revoked": "ABORTED", "finished": "FAILED_PRECONDITION"}
"""Status of a call whose caller is not a live member: register again / this incarnation is over / done."""


def compression_label(config: Config) -> str:
    """How gradients travel, for summaries: ``none``, ``topk(0.1)``, ``quantization(8)``."""
    system = config.system
    if not system.compression_enabled:
        return "none"
    if system.compression_type == "topk":
        return f"topk({system.compression_ratio:g})"
    return f"quantization({system.quantization_bits})"


class Refused(Exception):
    """A call the server refuses: ``code`` names the status (gRPC's names), ``message`` says what was wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class PushRefused(Refused):
    """A push refused for what it holds (malformed, not the caller's work, wrong version): counted and logged
    as ``push_refused`` (:meth:`ServerCore.refused`); a call refused for who makes it is a plain :class:`Refused`."""


class RunFailed(RuntimeError):
    """A background checkpoint or evaluation failed: the run stops with this error."""


def _spec(name: str, tensor: torch.Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, shape=list(tensor.shape))


@dataclass
class _StoredReply:
    """A push's reply kept for retries when replies are views (``reply_views``): its pieces and its message."""

    pieces: Pieces
    message: Any


class InlineExecutor(Executor):
    """Runs each submitted task at once, in the caller (a simulation's evaluations: no background thread)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001  (the future carries it, as a thread pool's would)
            future.set_exception(exc)
        return future


class ServerCore:
    """The run state of a parameter server and every decision it makes (see the module docstring).

    Args:
        config: the run's config (mode, workers, optimizer, heartbeats, outputs).
        work: where workers' work comes from.
        model: the model to serve; ``None``: the first worker's Initialize brings it.
        model_label: what checkpoints call the model (default ``training.model_architecture``).
        data_label: what summaries call the data (default ``training.dataset``).
        test_set: evaluate on it (every ``eval_interval`` versions, at epoch ends, at the end); ``None``: never.
        staleness_policy: async weight-or-reject policy (default ``StalenessPolicy.from_config(config.system)``).
        tensorboard: also write TensorBoard scalars next to ``events.jsonl``.
        resume: a checkpoint file or folder of an earlier server of this run to continue from.
        faults: fire the config's ``kill:server@version=N`` faults (``False`` in a restarted server).
        fire_fault: what a due server fault does (default: signal this process).
        clock: where time comes from (:mod:`src.clock`).
        background: runs evaluations (default: inline; a real server passes a one-thread pool).
        reply_views: Pull and Push replies are :class:`~src.wire.Pieces` over the tensors themselves
            (:class:`~src.wire.SharedBuffers`: copied only if the model changes while a reply is still being
            sent), for a transport that sends them outside the lock without joining them; each comes with a
            lease the sender gives back (:meth:`Pieces.release <src.wire.Pieces.release>`). Default: ``bytes``
            joined under the lock.
    """

    def __init__(
        self,
        config: Config,
        *,
        work: WorkSource,
        model: nn.Module | None,
        model_label: str | None = None,
        data_label: str | None = None,
        test_set: Any = None,
        staleness_policy: StalenessPolicy | None = None,
        tensorboard: bool = True,
        resume: str | Path | None = None,
        faults: bool = True,
        fire_fault: Callable[[FaultSpec], None] | None = None,
        clock: Clock = REAL_CLOCK,
        background: Executor | None = None,
        reply_views: bool = False,
    ):
        self.config = config
        t, system = config.training, config.system
        self.clock = clock
        self.reply_views = reply_views
        self.mode = system.aggregation_mode
        self.num_workers = system.num_workers
        self.work = work
        self.staleness_policy = staleness_policy or StalenessPolicy.from_config(system)
        # Adaptive compression (src/controller.py): fed this server's push and eval events; its decisions
        # go to the workers in every reply's Control and set the staleness policy's S_max.
        self.controller = CompressionController.from_config(system) if system.adaptive_compression else None
        if self.controller is not None and test_set is not None and not (t.eval_interval or t.eval_every_samples):
            raise SetupError(
                "system.adaptive_compression decides at evaluations: set training.eval_interval "
                "(server versions between evaluations) or training.eval_every_samples"
            )
        self.control = pb.Control()
        if self.controller is not None:
            self._set_control(self.controller.rho, self.controller.max_staleness)
        netem.check_workers(config.emulation, self.num_workers)
        self.model_label = model_label or t.model_architecture
        self.data_label = data_label or t.dataset
        self.test_set = test_set
        self.state: ModelState | None = None
        self.param_specs: list[pb.TensorSpec] = []
        self.buffer_specs: list[pb.TensorSpec] = []
        self.downlink = Downlink([], None, refresh_interval=1, drift_bound=1.0)  # replaced with the model
        self.max_message_bytes = MODELLESS_MAX_MESSAGE_BYTES
        self.serving = False  # once a transport serves, the message limit is fixed
        if model is not None:
            self._install_model(model)
        else:  # the first optimizer of a process costs seconds (lazy imports): not later, under the lock
            server_optimizer(config, [nn.Parameter(torch.zeros(1))])

        self.lock = threading.Condition()  # re-entrant: an inline evaluation decides under the caller's lock
        self.members = Membership(self.num_workers, system.heartbeat_timeout, clock=clock.monotonic)
        self.requests = RequestLog()
        self._round: SyncRound | None = None
        self._started = self.mode == "async"  # sync waits for every worker before its first round
        self._to_deliver: dict[int, list[Batch]] = {}  # work handed out, not yet in a reply
        self.stopping = False
        self.fatal: BaseException | None = None
        self.done = threading.Event()
        self.counters = Counter()  # pushes_applied / _rejected / _refused, samples_applied, workers_failed, ...
        self.staleness_histogram: Counter[int] = Counter()
        self.controller_decisions: Counter[str] = Counter()  # by action: hold / compress_less / compress_more
        self._ledger: list[torch.Tensor] | None = None  # system.gradient_ledger: sum of the applied gradients (float64)
        self._overriding_schedule: set[int] = set()  # workers warned that their own learning rates win
        self.stats_by_incarnation: dict[int, dict[str, Any]] = {}
        self._run_started = clock.time()
        self._train_started: float | None = None
        self._train_ended: float | None = None
        self.target = TimeToTarget(t.target_accuracy)
        self._faults = FaultInjector(system.inject_faults, "server", enabled=faults)
        self._fire_fault = fire_fault
        self._background = background or InlineExecutor()
        self.log = MetricsLogger(
            Path(system.log_dir) / "server",
            tensorboard=tensorboard and "tensorboard" in config.metrics.trackers,
            sinks=open_trackers(config, system.log_dir, resume=resume is not None),
            role="server",
            clock=clock.time,
        )
        self.resumed_from: Path | None = None
        if resume is not None:
            self._restore(resume)
        self.log.event(
            "run_start",
            architecture="parameter_server",
            config=config.to_dict(),
            clock=clock.kind,
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            version=self.version,
        )

    def _install_model(self, model: nn.Module) -> None:
        """Serve ``model``: its optimizer, specs, downlink and byte views (at construction, or lock held)."""
        system = self.config.system
        self.state = ModelState(model, server_optimizer(self.config, model.parameters()))
        self.param_specs = [_spec(n, p) for n, p in zip(self.state.param_names, self.state.params)]
        self.buffer_specs = [_spec(n, b) for n, b in zip(self.state.buffer_names, self.state.buffers)]
        self._param_shapes = [tuple(p.shape) for p in self.state.params]
        self._buffer_shapes = [tuple(b.shape) for b in self.state.buffers]
        self.downlink = Downlink(
            self.state.sent(),
            compressor_from_config(system),
            refresh_interval=system.downlink_refresh_interval,
            drift_bound=system.downlink_drift_bound,
        )
        # Byte views of what workers are sent, made once: the tensors are updated in place.
        self._param_views = [tensor_view(p) for p in self.state.sent()]
        self._buffer_views = [tensor_view(b) for b in self.state.buffers]
        self._shared: SharedBuffers | None = None  # reply_views: the current version's tensors, once a reply used them
        if self.reply_views:
            self.state.before_change = self._release_shared
        if not self.serving:
            model_bytes = 4 * sum(p.numel() for p in self.state.params + self.state.buffers)
            # A push is at most ~2x the model (top-k at ratio 1 sends value + index per entry).
            self.max_message_bytes = min(3 * model_bytes + (4 << 20), 2**31 - 1)
        if self.test_set is not None:
            self._eval_model = copy.deepcopy(model)
        self._schedule_next_step()

    @property
    def version(self) -> int:
        """The Server Version: optimizer steps taken (0 while there is no model yet)."""
        return self.state.version if self.state is not None else 0

    # ------------------------------------------------------------------------- calls (lock held)

    def register(self, request: pb.RegisterRequest, peer: str) -> tuple[pb.RegisterReply, list]:
        """A new incarnation of a worker id; returns the reply and the events to publish (a replaced incarnation)."""
        worker_id = self._free_worker_id() if request.any_worker_id else request.worker_id
        try:
            member, replaced = self.members.register(worker_id, request.pid)
        except ValueError as exc:
            raise Refused("INVALID_ARGUMENT", str(exc)) from None
        # Every incarnation is in the summary's workers, also one killed before its first heartbeat.
        self.record_stats(member, pb.WorkerStats(), final=False)
        events = []
        if replaced is not None:
            events += self._fail(replaced, reason="replaced by a new incarnation", silence=None)
        self.downlink.forget(worker_id)
        applied = bool(request.last_request_id) and self.requests.was_applied(worker_id, request.last_request_id)
        unknown = self.work.claim(worker_id, request.carried_batch_ids) if not applied else []
        self.lock.notify_all()
        rejoined = any(m.worker_id == worker_id for m in self.members.history[:-1])
        self.log.event(
            "worker_rejoined" if rejoined else "register",
            worker=worker_id,
            incarnation=member.incarnation,
            peer=peer,
            pid=request.pid,
            version=self.version,
            last_request_applied=applied,
            carried_batches=list(request.carried_batch_ids),
            carried_unknown=unknown,
        )
        if rejoined:  # a launcher waiting for a process it saw declared failed learns it came back
            events.append(
                ("worker_rejoined", {"worker": worker_id, "incarnation": member.incarnation, "pid": request.pid})
            )
        reply = pb.RegisterReply(
            worker_id=worker_id,
            incarnation=member.incarnation,
            session=member.session,
            version=self.version,
            run_config_json=self.config.model_dump_json(),
            parameter_specs=self.param_specs,
            buffer_specs=self.buffer_specs,
            last_request_applied=applied,
            model_wanted=self.state is None,
        )
        return reply, events

    def initialize(self, data) -> pb.InitializeReply:
        """A worker offers its model (layout and initial values) to a server that has none."""
        try:
            received = split(data, pb.InitializeRequest, ("parameters", "buffers"))
        except ValueError as exc:
            raise Refused("INVALID_ARGUMENT", f"initialize: {exc}") from None
        request = received.message
        layout = (
            [(s.name, tuple(s.shape)) for s in request.parameter_specs],
            [(s.name, tuple(s.shape)) for s in request.buffer_specs],
        )
        member = self.member(request.caller)
        if self.state is not None:  # another worker's model came first, or the server has its own
            mismatch = layout_mismatch(
                layout, (self.state.param_names, self._param_shapes), (self.state.buffer_names, self._buffer_shapes)
            )
            if mismatch:
                raise Refused(
                    "FAILED_PRECONDITION",
                    f"worker {member.worker_id}: its model does not match the server's: {mismatch}",
                )
            return pb.InitializeReply(accepted=False, version=self.state.version)
        try:
            model = model_from_layout(*layout, received.large["parameters"], received.large["buffers"])
        except ValueError as exc:
            raise Refused("INVALID_ARGUMENT", f"initialize: {exc}") from None
        self._install_model(model)
        self.lock.notify_all()
        self.log.event(
            "model_initialized",
            worker=member.worker_id,
            incarnation=member.incarnation,
            parameters=len(layout[0]),
            buffers=len(layout[1]),
            numel=sum(p.numel() for p in self.state.params),
        )
        return pb.InitializeReply(accepted=True, version=0)

    def begin_pull(self, caller: pb.Caller) -> Member:
        """A Pull: the caller is ready (sync rounds wait for ready workers); then wait for :meth:`poll_work`."""
        member = self.member(caller)
        self.require_model()
        if not member.ready:
            member.ready = True
            self._maybe_start()
        return member

    def pull_reply(self, member: Member, work: tuple[list[Batch] | None, bool]) -> bytes | Pieces:
        """The serialized Pull reply: dense parameters (a pull starts the worker afresh) and ``work``."""
        self.downlink.forget(member.worker_id)
        message = pb.PullReply(version=self.state.version, work=self.work.message(*work), control=self.control)
        with tracing.span("reply", worker=member.worker_id):
            return self._reply_bytes(message, member.worker_id)

    def begin_push(self, caller: pb.Caller, request: pb.PushRequest) -> Member | bytes | Pieces | object:
        """Admit a push: its member, or the stored reply of a retried push, or ``RequestLog.IN_PROGRESS``
        while the first copy of this request is still being handled (wait, then call again).

        On a member, the request is in progress until :meth:`push_reply` or :meth:`abandon`.
        """
        member = self.member(caller)
        self.require_model()
        worker_id, request_id = member.worker_id, request.request_id
        if request_id == 0:
            raise PushRefused("INVALID_ARGUMENT", "push: request_id must be non-zero (unique per push)")
        remembered = self.requests.lookup(worker_id, request_id)
        if remembered is RequestLog.SUPERSEDED:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"push {request_id} of worker {worker_id} was handled already "
                f"and is not its newest push (request ids are unique per push)",
            )
        if isinstance(remembered, _StoredReply):  # a retry of a handled push, replies as views
            return self._stored_reply(member, remembered)
        if isinstance(remembered, pb.PushReply):  # a retry of a handled push, dense replies: the verdict again,
            return self._rebuilt_reply(member, remembered)  # with the parameters as they are now
        if remembered is not None:
            return remembered  # IN_PROGRESS, or a retry of a handled push: answer again, apply nothing
        try:
            self.work.check_covers(worker_id, request)
        except WorkRefused as exc:
            raise PushRefused(exc.code, exc.message) from None
        self.requests.begin(worker_id, request_id)
        return member

    def decode(self, worker_id: int, received: Received) -> Contribution:
        """Check and decompress a push's tensors (no lock needed); raises :class:`Refused` naming the problem."""
        with tracing.span("decode", worker=worker_id, request_id=received.message.request_id):
            return self._decode(worker_id, received)

    def _decode(self, worker_id: int, received: Received) -> Contribution:
        request, payloads, raw_buffers = received.message, received.large["gradients"], received.large["buffers"]
        learning_rate = request.learning_rate if request.HasField("learning_rate") else None
        if learning_rate is not None and not (math.isfinite(learning_rate) and learning_rate >= 0):
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"push from worker {worker_id}: learning_rate must be a finite "
                f"number >= 0 (or not set), got {learning_rate}",
            )
        if self.work.owns_data:
            if not payloads and not raw_buffers:
                if request.num_samples != 0:
                    raise PushRefused(
                        "INVALID_ARGUMENT",
                        f"push from worker {worker_id} has no gradients but num_samples "
                        f"{request.num_samples} (a skipped step has num_samples 0)",
                    )
                return Contribution(worker_id, 0, [], [], request.request_id)  # a skipped step
            if request.num_samples <= 0:
                raise PushRefused(
                    "INVALID_ARGUMENT",
                    f"push from worker {worker_id}: num_samples must be > 0, got {request.num_samples}",
                )
        if len(payloads) != len(self.state.params):
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"push carries {len(payloads)} gradients, the model has {len(self.state.params)} parameters",
            )
        gradients = []
        for index, (payload, spec, shape) in enumerate(zip(payloads, self.param_specs, self._param_shapes)):
            try:
                header = parse_header(payload)  # before decompressing: the header bounds the allocation
                if header.shape != shape:
                    raise ValueError(f"shape {list(header.shape)}, expected {list(shape)}")
                # copy=False: identity gradients stay read-only views of the message (nothing writes them)
                gradients.append(
                    decompress(payload, copy=False, header=header)
                )  # refuses malformed buffers and NaN/Inf
            except ValueError as exc:
                raise PushRefused("INVALID_ARGUMENT", f"gradient {index} ({spec.name}): {exc}") from None
        buffers = []
        if raw_buffers:
            if len(raw_buffers) != len(self.state.buffers):
                raise PushRefused(
                    "INVALID_ARGUMENT",
                    f"push carries {len(raw_buffers)} buffers, the model has {len(self.state.buffers)}",
                )
            for data, spec, shape in zip(raw_buffers, self.buffer_specs, self._buffer_shapes):
                try:
                    check_float32_bytes(data, math.prod(shape), f"buffer {spec.name}")
                except ValueError as exc:
                    raise PushRefused("INVALID_ARGUMENT", str(exc)) from None
                values = torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
                if not bool(torch.isfinite(values).all()):
                    raise PushRefused("INVALID_ARGUMENT", f"buffer {spec.name}: holds NaN or Inf values")
                buffers.append(values)
        return Contribution(
            worker_id, request.num_samples, gradients, buffers, request.request_id, learning_rate=learning_rate
        )

    def apply_push(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> pb.PushReply:
        """Add the decoded push to the barrier (sync) or apply it with its staleness weight (async): the verdict."""
        if request.HasField("learning_rate") and member.worker_id not in self._overriding_schedule:
            self._overriding_schedule.add(member.worker_id)
            schedule = self.config.training.lr_schedule
            if not is_constant(schedule):
                logger.warning(
                    "worker %d sends the learning rate of its own scheduler with its pushes: the server "
                    "applies it, not its training.lr_schedule (%s)",
                    member.worker_id,
                    schedule.kind,
                )
                self.log.event(
                    "lr_schedule_overridden",
                    worker=member.worker_id,
                    learning_rate=request.learning_rate,
                    schedule=schedule.kind,
                )
        with tracing.span("apply", worker=member.worker_id, request_id=request.request_id):
            verdict = (self._add_to_round if self.mode == "sync" else self._apply_now)(member, request, contribution)
        self.lock.notify_all()
        return verdict

    def push_reply(
        self, member: Member, request_id: int, verdict: pb.PushReply, work: tuple[list[Batch] | None, bool]
    ) -> bytes | Pieces:
        """The serialized Push reply (verdict, parameters, ``work``), remembered for retries of ``request_id``."""
        verdict.work.CopyFrom(self.work.message(*work))
        verdict.version = self.state.version
        verdict.control.CopyFrom(self.control)
        with tracing.span("reply", worker=member.worker_id):
            reply = self._reply_bytes(verdict, member.worker_id)
        # For a retry: views are kept with their verdict (rebuilt if the model moved on); bytes of a delta reply
        # only as they were (the worker's copy follows the deltas it got); a dense one is rebuilt from the verdict,
        # so a model-sized reply is not kept per worker.
        if self.reply_views:
            stored = _StoredReply(reply, verdict)
        else:
            stored = reply if self.downlink.compressor is not None else verdict
        self.requests.finish(member.worker_id, request_id, stored, applied=verdict.accepted)
        self.lock.notify_all()
        return reply

    def abandon(self, worker_id: int, request_id: int) -> None:
        """A push ended without a reply (refused, or its caller gone): a retry is handled afresh."""
        if self.requests.lookup(worker_id, request_id) is RequestLog.IN_PROGRESS:
            self.requests.abandon(worker_id, request_id)
        self.lock.notify_all()

    def refused(self, worker_id: int | None, request_id: int, refused: PushRefused) -> None:
        """Count and log a refused push (the driver then refuses the call)."""
        self.counters["pushes_refused"] += 1
        self.log.event(
            "push_refused", worker=worker_id, request_id=request_id, code=refused.code, reason=refused.message
        )

    def heartbeat(self, caller: pb.Caller, stats: pb.WorkerStats) -> pb.HeartbeatReply:
        member = self.member(caller)
        self.record_stats(member, stats, final=False)
        return pb.HeartbeatReply(version=self.version)

    def finish(self, caller: pb.Caller, stats: pb.WorkerStats) -> pb.FinishReply:
        """A worker leaves (planned work: only once the run is finished) with its totals for the summary."""
        member = self.member(caller)
        refusal = self.work.finish_refused()
        if refusal is not None:
            raise Refused("FAILED_PRECONDITION", f"worker {member.worker_id}: {refusal}")
        values = self.record_stats(member, stats, final=True)
        self.members.finish(member)
        if self.state is not None:
            self.state.forget_worker(member.worker_id)
        self._to_deliver.pop(member.worker_id, None)
        if self._round is not None and self._round.drop(member.worker_id):
            self._maybe_complete_round()
        self._maybe_start()  # a sync run waiting for everyone may now start without it
        self._check_done()
        self.lock.notify_all()
        self.log.event(
            "worker_finished", worker=member.worker_id, incarnation=member.incarnation, version=self.version, **values
        )
        return pb.FinishReply(version=self.version)

    def status(self) -> pb.StatusReply:
        current = self.members.current
        return pb.StatusReply(
            version=self.version,
            aggregation_mode=self.mode,
            num_workers=self.num_workers,
            registered=sorted(w for w, m in current.items() if m.state != "awaited"),
            finished=sorted(w for w, m in current.items() if m.state == "finished"),
            pushes_applied=self.counters["pushes_applied"],
            pushes_rejected=self.counters["pushes_rejected"],
            pushes_refused=self.counters["pushes_refused"],
            done=self.done.is_set(),
            workers=[
                pb.WorkerState(worker_id=m.worker_id, incarnation=m.incarnation, state=m.state)
                for m in self.members.history
            ],
            epochs_done=self.work.epochs_done(),
        )

    def expire(self) -> list:
        """Fail every worker silent for longer than ``heartbeat_timeout``; returns the events to publish."""
        events = []
        awaited = set(self.members.awaited())
        for member, silence in self.members.expire():
            reason = (
                f"did not register with the restarted server within {silence:.2f} s"
                if member.worker_id in awaited
                else f"silent for {silence:.2f} s"
            )
            events += self._fail(member, reason=reason, silence=silence)
        return events

    def stop(self) -> None:
        """Waiting calls end (:meth:`poll_work` refuses with UNAVAILABLE)."""
        self.stopping = True
        self.lock.notify_all()

    # ------------------------------------------------------------------------- checks and waits (lock held)

    def member(self, caller: pb.Caller) -> Member:
        """The live member behind ``caller``, marked as seen; refuses the call otherwise."""
        try:
            return self.members.check(caller.worker_id, caller.session)
        except MembershipError as exc:
            raise Refused(MEMBERSHIP_CODES[exc.kind], exc.message) from None

    def require_model(self) -> None:
        """Refuse the call while the server has no model yet."""
        if self.state is None:
            raise Refused("FAILED_PRECONDITION", "the server has no model yet: send Initialize first")

    def _free_worker_id(self) -> int:
        """The lowest worker id no live incarnation holds; refuses when all are held."""
        live = set(self.members.live())
        free = [w for w in range(self.num_workers) if w not in live]
        if not free:
            raise Refused(
                "RESOURCE_EXHAUSTED", f"all {self.num_workers} worker ids are held by live workers (system.num_workers)"
            )
        return free[0]

    def poll_work(self, member: Member) -> tuple[list[Batch] | None, bool] | None:
        """``member``'s work for its reply, if there is some now: ``(batches, finished)``; ``None``: wait.

        Raises:
            Refused: the member is no longer live, the run failed, or the server is stopping.
        """
        self.check_waiting(member)
        worker = member.worker_id
        if worker in self._to_deliver:
            return self._to_deliver.pop(worker), False
        if self.mode == "async":
            batches = self.work.next_for(worker, self.members.live())
            if batches is not None:
                self._training_clock_starts()
                return batches, False
        if self.work.finished():
            return None, True
        if self.stopping:
            raise Refused("UNAVAILABLE", "the parameter server is shutting down")
        return None

    def check_waiting(self, member: Member) -> None:
        """Refuse a waiting call whose member is no longer live, or when the run failed."""
        try:
            self.members.verify(member)  # not a sign of life: a hung process's open call must not keep it alive
        except MembershipError as exc:
            raise Refused(MEMBERSHIP_CODES[exc.kind], exc.message) from None
        if self.fatal is not None:
            raise Refused("INTERNAL", f"the server stopped the run: {self.fatal}")

    # ------------------------------------------------------------------------- aggregation (lock held)

    def _add_to_round(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> pb.PushReply:
        round_ = self._round
        if not contribution.gradients:  # a skipped step (client-owned work): this version goes on without it
            if (
                round_ is None
                or request.base_version != round_.version
                or member.worker_id not in round_.expected
                or member.worker_id in round_.arrived
            ):
                raise PushRefused(
                    "FAILED_PRECONDITION",
                    f"skipped step of worker {member.worker_id} for version {request.base_version}, which is "
                    f"not its turn (barrier at version {round_.version if round_ else self.state.version})",
                )
            round_.drop(member.worker_id)  # it is in the next round again
            reply = self._skipped(member, request)
            self._maybe_complete_round()
            return reply
        if round_ is None or request.base_version != round_.version:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"sync push for version {request.base_version}, but the barrier is at "
                f"version {round_.version if round_ else self.state.version}",
            )
        try:
            round_.add(contribution)
        except ValueError as exc:
            raise PushRefused("FAILED_PRECONDITION", str(exc)) from None
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
            self._set_step_learning_rate(contributions)
            self.state.step(gradients, buffers)
            self._round = None
            self._applied(contributions)
        if self._round is None or not self._round.expected:
            self._round = None
            self._open_round()

    def _open_round(self) -> None:
        """sync: hand every ready worker its next work for the current version."""
        if not self._started or self._round is not None or self.state is None:
            return
        handed = self.work.start_round(self.members.ready(), self.members.live())
        if handed:
            self._round = SyncRound(self.state.version, set(handed))
            self._to_deliver.update(handed)
            self._training_clock_starts()
        self._check_done()

    def _apply_now(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> pb.PushReply:
        if not contribution.gradients:
            return self._skipped(member, request)
        if request.base_version > self.state.version:
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"base_version {request.base_version} is ahead of the server's version {self.state.version}",
            )
        staleness = self.state.version - request.base_version
        self.staleness_histogram[staleness] += 1
        weight, reason = self.staleness_policy.verdict(staleness)
        self._log_push(member, request, staleness=staleness, weight=weight, accepted=weight is not None, reason=reason)
        if weight is None:
            self.counters["pushes_rejected"] += 1
            return pb.PushReply(
                accepted=False, staleness=staleness, weight=0.0, reason=f"rejected by the staleness policy: {reason}"
            )
        self._set_step_learning_rate([contribution])
        self.state.step(contribution.gradients, contribution.buffers, weight, worker=member.worker_id)
        self._applied([contribution])
        return pb.PushReply(accepted=True, staleness=staleness, weight=weight)

    def _skipped(self, member: Member, request: pb.PushRequest) -> pb.PushReply:
        self.counters["steps_skipped"] += 1
        self.log.event(
            "push_skipped",
            worker=member.worker_id,
            incarnation=member.incarnation,
            request_id=request.request_id,
            base_version=request.base_version,
            version=self.state.version,
        )
        return pb.PushReply(accepted=False, reason="skipped step (no gradient)", staleness=0, weight=0.0)

    def _applied(self, contributions: list[Contribution]) -> None:
        """The update just stepped holds everything its contributors held: bookkeeping, events, checkpoints."""
        samples, epochs_done = [], []
        samples_before = self.counters["samples_applied"]
        for contribution in contributions:
            self.requests.mark(contribution.worker, contribution.request_id, applied=True)  # before a checkpoint below
            if self.config.system.gradient_ledger:
                self._add_to_ledger(contribution.gradients)
            batches, finished_epochs = self.work.applied(contribution.worker)
            samples += [[b.epoch, list(b.indices)] for b in batches]
            epochs_done += finished_epochs
            self.counters["samples_applied"] += contribution.num_samples  # checked to equal its batches' samples
        self.counters["pushes_applied"] += len(contributions)
        version = self.state.version
        self.log.event(
            "update",
            version=version,
            requests=[[c.worker, c.request_id] for c in contributions],
            samples=samples,
            num_samples=sum(c.num_samples for c in contributions),
            learning_rate=self.state.learning_rate,
        )
        if all(c.learning_rate is None for c in contributions):
            self._schedule_next_step()
        self._after_version(epochs_done, samples_before)
        self._faults.reached(
            version,
            announce=lambda fault: self.log.event("fault_injected", fault=str(fault), version=version),
            fire=self._fire_fault,
        )
        if self.work.finished() and self._train_ended is None:
            self._train_ended = self.clock.time()
        self._check_done()

    def _set_step_learning_rate(self, contributions: list[Contribution]) -> None:
        """The rate of the update about to be applied: the one the pushes' own schedulers sent (their mean),
        else the schedule's (already set for this version)."""
        sent = [c.learning_rate for c in contributions if c.learning_rate is not None]
        if sent:
            self.state.set_learning_rate(sum(sent) / len(sent))
        else:
            self._schedule_next_step()

    def _schedule_next_step(self) -> None:
        """``training.lr_schedule``'s rate for the step from the current version (the lookahead point uses it too)."""
        t = self.config.training
        self.state.set_learning_rate(scheduled_learning_rate(t.lr_schedule, t.learning_rate, self.state.version))

    def _add_to_ledger(self, gradients: list[torch.Tensor]) -> None:
        if self._ledger is None:
            self._ledger = [torch.zeros(g.shape, dtype=torch.float64) for g in gradients]
        for total, gradient in zip(self._ledger, gradients):
            total.add_(gradient.to(torch.float64))

    def _log_push(
        self,
        member: Member,
        request: pb.PushRequest,
        *,
        staleness: int,
        weight: float | None,
        accepted: bool,
        reason: str | None = None,
    ) -> None:
        """The push event: its Staleness, weight and verdict (with the policy's reason), batches and timings."""
        metrics = request.metrics
        event = self.log.event(
            "push",
            worker=member.worker_id,
            incarnation=member.incarnation,
            request_id=request.request_id,
            base_version=request.base_version,
            version=self.state.version,
            staleness=staleness,
            weight=weight,
            accepted=accepted,
            reason=reason,
            num_samples=request.num_samples,
            batch_ids=list(request.batch_ids),
            epoch=metrics.epoch,
            loss=metrics.loss,
            gradient_time_s=metrics.gradient_time_s,
            compression_time_s=metrics.compression_time_s,
            communication_time_s=metrics.communication_time_s,
        )
        if self.controller is not None:
            self.controller.observe(event)  # timings only; decisions come at evaluations

    # ------------------------------------------------------------------------- membership (lock held)

    def _maybe_start(self) -> None:
        """sync: the first round starts once every worker id has registered and every live one is ready."""
        ready = self.members.ready()
        if (
            not self._started
            and ready
            and len(self.members.current) == self.num_workers
            and ready == self.members.live()
            and not self.members.awaited()
        ):
            self._started = True
        if self._started and self.mode == "sync":
            self._open_round()

    def _training_clock_starts(self) -> None:
        if self._train_started is None:
            self._train_started = self.clock.time()

    def _fail(self, member: Member, *, reason: str, silence: float | None) -> list:
        """``member`` is gone: leave the barrier, hand its work to the live workers. Returns events to publish."""
        self.members.fail(member)
        worker = member.worker_id
        self.counters["workers_failed"] += 1
        self._to_deliver.pop(worker, None)
        if self.state is not None:
            self.state.forget_worker(worker)
        if self._round is not None:
            self._round.drop(worker)
        moved = self.work.release(worker, self.members.live())
        self.log.event(
            "worker_failed",
            worker=worker,
            incarnation=member.incarnation,
            pid=member.pid,
            reason=reason,
            silent_for_s=silence,
            version=self.version,
        )
        if moved:
            self.log.event(
                "work_reassigned",
                worker=worker,
                version=self.version,
                batches={str(to): [b.batch_id for b in bs] for to, bs in moved.items()},
                samples=sum(len(b.indices) for bs in moved.values() for b in bs),
            )
        if self.mode == "sync" and self.state is not None:
            self._maybe_start()
            self._maybe_complete_round()
        self._check_done()
        self.lock.notify_all()
        return [("worker_failed", {"worker": worker, "incarnation": member.incarnation, "pid": member.pid})]

    def record_stats(self, member: Member, stats: pb.WorkerStats, *, final: bool) -> dict[str, Any]:
        values = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
        self.stats_by_incarnation[member.incarnation] = {
            "worker_id": member.worker_id,
            "incarnation": member.incarnation,
            "final": final,
            **values,
        }
        return values

    def _check_done(self) -> None:
        """The run is over when the work source says so (nothing left to do, no live worker)."""
        if self.work.over(self.members):
            if self._train_ended is None:
                self._train_ended = self.clock.time()
            self.done.set()
            self.lock.notify_all()

    # ------------------------------------------------------------------------- replies

    def _reply_bytes(self, message, worker: int) -> bytes | Pieces:
        """``message`` with the current parameters (dense, or a delta for ``worker``) and buffers, serialized
        (``reply_views``: as pieces over the tensors themselves, with a lease the sender gives back)."""
        self.state.sent()  # the lookahead point of this version, when workers are sent one
        downlink = self.downlink.encode(worker, self.state.version)
        if self.reply_views:
            shared = self._shared_views()
            params = [shared.ref(i) for i in range(len(self._param_views))]
            buffers = [shared.ref(len(params) + i) for i in range(len(self._buffer_views))]
        else:
            params, buffers = self._param_views, self._buffer_views
        tensors = {"parameters": params} if downlink.dense else {"parameter_deltas": downlink.payloads}
        outgoing = Outgoing(message, {**tensors, "buffers": buffers})
        if not self.reply_views:
            return serialize(outgoing)
        shared.acquire()  # valid: it is the current version's (the lock is held)
        return encode(outgoing)

    def _shared_views(self) -> SharedBuffers:
        """The current version's tensors as :class:`~src.wire.SharedBuffers` (made at its first reply)."""
        if self._shared is None:
            self._shared = SharedBuffers(self._param_views + self._buffer_views)
        return self._shared

    def _release_shared(self) -> None:
        """The model is about to change: replies still being sent from it get a copy, the rest drop it."""
        if self._shared is not None:
            self._shared.before_write()
            self._shared = None

    def _stored_reply(self, member: Member, remembered: "_StoredReply") -> Pieces:
        """A retried push's reply again (with a lease); rebuilt when the model changed since and no send kept
        the first one's bytes."""
        reply = remembered.pieces
        if reply.shared is None or reply.shared.acquire():
            return reply
        remembered.pieces = self._rebuilt_reply(member, remembered.message)
        return remembered.pieces

    def _rebuilt_reply(self, member: Member, verdict: pb.PushReply) -> bytes | Pieces:
        """A handled push's verdict and work as answered, with this version's parameters, dense; nothing applied."""
        message = pb.PushReply()
        message.CopyFrom(verdict)
        message.version = self.state.version
        message.control.CopyFrom(self.control)
        self.downlink.forget(member.worker_id)  # dense: what the worker holds is unknown
        return self._reply_bytes(message, member.worker_id)

    # ------------------------------------------------------------------------- evaluation, checkpoints

    def _after_version(self, epochs_done: list[int], samples_before: int) -> None:
        version = self.state.version
        t = self.config.training
        if version % t.checkpoint_interval == 0:
            # Written before any further update (lock held): a server killed at any moment loses fewer than
            # checkpoint_interval versions. A background write could be overtaken by the next checkpoint.
            self._write_numbered_checkpoint(version, self._checkpoint_state())
        evaluate_now = bool(epochs_done) and epochs_done[-1] + 1 < t.num_epochs  # the final evaluation covers the last
        if t.eval_interval and version % t.eval_interval == 0:
            evaluate_now = True
        samples = self.counters["samples_applied"]
        if samples_due(samples_before, samples, t.eval_every_samples):  # the same sample counts in sync and async
            evaluate_now = True
        if self.test_set is not None and evaluate_now:
            epoch = self.work.epochs_done()
            self._submit(self._evaluate_snapshot, epoch, version, self.state.snapshot(), self.elapsed(), samples)

    def _submit(self, function, *args) -> None:
        self._background.submit(function, *args).add_done_callback(self._background_done)

    def _background_done(self, future: Future) -> None:
        error = future.exception()
        if error is not None and self.fatal is None:
            self.fatal = error
            self.done.set()
            with self.lock:
                self.lock.notify_all()

    def elapsed(self) -> float:
        """Seconds on the training clock: from the first work handed out (0 before)."""
        return self.clock.time() - self._train_started if self._train_started is not None else 0.0

    def _checkpoint_state(self) -> dict[str, Any]:
        """Everything a resumed server needs, copied under the lock."""
        return {
            "model": self.state.snapshot(),
            "optimizer": copy.deepcopy(self.state.optimizer.state_dict()),
            "version": self.state.version,
            "epochs_done": self.work.epochs_done(),
            "extra": {
                "version": self.state.version,
                "aggregation_mode": self.mode,
                "num_workers": self.num_workers,
                "work": self.work.state_dict(),
                "requests": self.requests.state_dict(),
                "next_incarnation": self.members.next_incarnation,
                # the workers a restarted server waits for (and fails, if they stay silent: a hang while it was down)
                "live_workers": [
                    [m.worker_id, m.incarnation, m.pid]
                    for m in self.members.current.values()
                    if m.state in ("live", "awaited")
                ],
                "counters": dict(self.counters),
                "staleness_histogram": {str(k): v for k, v in self.staleness_histogram.items()},
                "controller": None
                if self.controller is None
                else {"state": self.controller.state_dict(), "decisions": dict(self.controller_decisions)},
                "stats_by_incarnation": {str(k): dict(v) for k, v in self.stats_by_incarnation.items()},
                "run_started_wall": self._run_started,
                "train_started_wall": self._train_started,
                "time_to_target": [self.target.seconds, self.target.step],
                "layout": {"parameters": list(self.state.param_names), "buffers": list(self.state.buffer_names)},
            },
        }

    def _checkpoint(self, path: Path, state: dict[str, Any]) -> Path:
        with tracing.span("checkpoint", version=state["version"]):
            checkpoint = make_checkpoint(
                model_state_dict=state["model"],
                optimizer_state_dict=state["optimizer"],
                model_architecture=self.model_label,
                dataset=self.data_label,
                epoch=state["epochs_done"],
                step=state["version"],
                config=self.config.to_dict(),
                extra=state["extra"],
            )
            return save_checkpoint(path, checkpoint)

    def _write_numbered_checkpoint(self, version: int, state: dict[str, Any]) -> None:
        """Write ``checkpoint_<version>.pt``; a failure is an event and ends the run with an error."""
        try:
            directory = Path(self.config.system.checkpoint_dir)
            written = self._checkpoint(numbered_path(directory, version), state)
            prune_checkpoints(directory, KEEP_CHECKPOINTS)
            self.log.event("checkpoint", path=str(written), version=version)
        except Exception as exc:
            self.log.event("checkpoint_failed", version=version, error=f"{type(exc).__name__}: {exc}")
            self.fatal = RunFailed(f"checkpoint at version {version} failed: {type(exc).__name__}: {exc}")
            self.done.set()
            self.lock.notify_all()

    def _restore(self, target: str | Path) -> None:
        """Continue from a checkpoint of this run's server (strictly: it must be one)."""
        path, checkpoint = load_latest_good(target)
        extra = checkpoint["extra"]
        if (
            "work" not in extra
            or extra.get("num_workers") != self.num_workers
            or extra.get("aggregation_mode") != self.mode
        ):
            raise CheckpointError(
                f"--resume {path}: not a checkpoint of a {self.mode} parameter-server run with "
                f"{self.num_workers} workers"
            )
        check_model_matches(path, checkpoint, self.model_label)
        if self.state is None:  # a server that takes its model from a worker: the checkpoint holds it
            layout = extra.get("layout")
            if layout is None:
                raise CheckpointError(f"--resume {path}: the checkpoint does not record its model's layout")
            state = checkpoint["model_state_dict"]
            self._install_model(
                model_from_layout(
                    [(n, tuple(state[n].shape)) for n in layout["parameters"]],
                    [(n, tuple(state[n].shape)) for n in layout["buffers"]],
                    [state[n] for n in layout["parameters"]],
                    [state[n] for n in layout["buffers"]],
                )
            )
        self.state.model.load_state_dict(checkpoint["model_state_dict"])
        self.state.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        self.state.version = extra["version"]
        self._schedule_next_step()  # the schedule goes on from the checkpoint's version
        self.work.load_state_dict(extra["work"])
        self.requests.load_state_dict(extra["requests"])
        self.members.next_incarnation = extra["next_incarnation"]
        for worker_id, incarnation, pid in extra.get("live_workers", []):
            self.members.await_(worker_id, incarnation, pid)
        self.counters.update(extra["counters"])
        self.staleness_histogram.update({int(k): v for k, v in extra["staleness_histogram"].items()})
        if self.controller is not None and extra.get("controller"):
            self.controller.load_state_dict(extra["controller"]["state"])
            self.controller_decisions.update(extra["controller"]["decisions"])
            self._set_control(self.controller.rho, self.controller.max_staleness)
        self.stats_by_incarnation = {int(k): v for k, v in extra["stats_by_incarnation"].items()}
        self._run_started = extra["run_started_wall"]
        self._train_started = extra["train_started_wall"]
        self.target.seconds, self.target.step = extra["time_to_target"]
        self.resumed_from = path
        events_path = Path(self.config.system.log_dir) / "server" / "events.jsonl"
        reached = (
            max((e["version"] for e in read_events(events_path, "update")), default=self.state.version)
            if events_path.is_file()
            else self.state.version
        )
        self.counters["server_recoveries"] += 1
        self.counters["versions_lost"] += max(0, reached - self.state.version)
        self.log.event(
            "server_recovered",
            checkpoint=str(path),
            version=self.state.version,
            versions_lost=max(0, reached - self.state.version),
        )

    def _evaluate_snapshot(
        self, epoch: int, version: int, state: dict[str, torch.Tensor], elapsed: float, samples: int
    ) -> None:
        self._eval_model.load_state_dict(state)
        self._record_eval(epoch, version, self._eval_model, elapsed, samples)

    def _record_eval(
        self, epoch: int, version: int, model: nn.Module, elapsed: float, samples: int
    ) -> tuple[float, float]:
        t = self.config.training
        with tracing.span("evaluate", version=version):
            loss, accuracy = evaluate(model, self.test_set, batch_size=t.eval_batch_size)
        event = self.log.scalars(
            "eval",
            version,
            {"test_loss": loss, "test_accuracy": accuracy},
            epoch=epoch,
            elapsed_s=elapsed,
            samples=samples,
        )
        if self.controller is not None:
            with self.lock:
                self._decide(event)
        if self.target.observe(accuracy, elapsed, version):
            self.log.event("target_reached", version=version, elapsed_s=elapsed, accuracy=accuracy)
        logger.info(
            "epoch %d/%d: test accuracy %.2f%%, test loss %.4f (server version %d)",
            epoch,
            t.num_epochs,
            accuracy * 100,
            loss,
            version,
        )
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
        self.control = pb.Control(compression_ratio=rho if compresses_topk else 0.0, max_staleness=max_staleness)
        self.staleness_policy = self.staleness_policy.with_max_staleness(max_staleness)

    def _emulation_summary(self, downlink_delay_s: dict[int, float] | None) -> dict[str, Any] | None:
        """Which emulation was on (``None``: none) and the downlink delay each worker's replies waited."""
        described = netem.describe(self.config.emulation, self.num_workers)
        if described is not None and downlink_delay_s:
            described["downlink_delay_s"] = {str(k): v for k, v in downlink_delay_s.items()}
        return described

    def finalize(
        self,
        summary_json: str | Path | None = None,
        *,
        downlink_delay_s: dict[int, float] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """After the run is over: final evaluation, final checkpoint, run summary (returned and written).

        Args:
            downlink_delay_s: seconds each worker's replies waited on its emulated downlink (the driver's).
            extra: fields the driver adds to the summary.

        Raises:
            RunFailed: a background checkpoint or evaluation failed, or no worker ever sent a model.
        """
        self._background.submit(lambda: None).result()  # let a pending checkpoint or evaluation finish first
        if self.fatal is not None:
            raise RunFailed(str(self.fatal)) from self.fatal
        if self.state is None:
            raise RunFailed("the run ended before any worker sent its model (Initialize)")
        t = self.config.training
        with self.lock:
            state = self._checkpoint_state()
            workers = [exposed_communication(self.stats_by_incarnation[i]) for i in sorted(self.stats_by_incarnation)]
        version = state["version"]
        elapsed = self.elapsed() if self._train_ended is None else self._train_ended - (self._train_started or 0.0)
        final_loss, final_accuracy = (
            self._record_eval(t.num_epochs, version, self.state.model, elapsed, self.counters["samples_applied"])
            if self.test_set is not None
            else (float("nan"), float("nan"))
        )
        checkpoint_path = self._checkpoint(
            final_checkpoint_path(self.config.system.checkpoint_dir, "parameter_server"), state
        )
        if self.config.system.gradient_ledger:
            ledger = dict(
                zip(
                    self.state.param_names,
                    self._ledger or [torch.zeros(p.shape, dtype=torch.float64) for p in self.state.params],
                )
            )
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
            "total_time_s": self.clock.time() - self._run_started,
            "train_time_s": train_time,
            "clock": self.clock.kind,
            "training_clock": "from the first work handed to a worker to the last update applied; includes server restarts",
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
            "controller": None
            if self.controller is None
            else {
                "decisions": dict(self.controller_decisions),
                "final_compression_ratio": self.control.compression_ratio or None,
                "final_max_staleness": self.controller.max_staleness,
            },
            **self.target.fields(),
            "gradient_time_s": sum(w["gradient_time_s"] for w in workers),
            "compression_time_s": sum(w["compression_time_s"] for w in workers),
            "communication_time_s": sum(w["communication_time_s"] for w in workers),
            "exposed_communication_s": sum(w["exposed_communication_s"] for w in workers),
            "faults": {
                "worker_failures": self.counters["workers_failed"],
                "server_recoveries": self.counters["server_recoveries"],
                "versions_lost": self.counters["versions_lost"],
            },
            "worker_incarnations": len(workers),
            "workers": workers,
            "emulation": self._emulation_summary(downlink_delay_s),
            **(extra or {}),
        }
        if self.work.owns_data:
            summary["steps_skipped"] = self.counters["steps_skipped"]
        self.log.event("run_end", **{k: v for k, v in summary.items() if k != "workers"})
        summary_path = write_summary(summary_json or Path(self.config.system.log_dir) / "summary.json", summary)
        self.log.finish(summary, artifacts=[summary_path, checkpoint_path])
        return summary

    def close(self) -> None:
        """Wait for background work and close the event log."""
        self._background.shutdown(wait=True)
        self.log.close()
