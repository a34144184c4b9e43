"""The parameter server's logic, with no transport in it: the one implementation every driver runs.

Drivers: the gRPC service (:mod:`src.parameter_server`), the library's server for client-owned work
(:mod:`src.torch_asgc.server`) and the virtual-time simulation (:mod:`src.virtual.run`). They move
bytes and decide *when* things happen; everything the server *decides* is here, so a simulation and
a real server cannot disagree.

A run has ``system.num_workers`` worker ids. A worker registers (a new incarnation, with a session
secret every later call must carry), pulls the parameters and its first work, then loops: train on
the work it was handed -> push the gradient -> the reply carries the verdict, the parameters to
train on next and the next work (one call per step). Where work comes from is the
:class:`~src.ps.server.work_source.WorkSource`: the dataset's plan, or the workers' own loops.

* **sync**: one barrier per version among the workers handed work for it (:class:`src.ps.state.aggregation.SyncRound`);
  the sample-weighted mean of their gradients is one optimizer step. The first round starts when
  all ``num_workers`` workers are ready.
* **async**: each push is judged by the staleness policy (weight, or reject: the worker then rolls
  its error feedback back and the push's batches stay with it) and applied at once.

The core owns its collaborators, one concept each: :class:`~src.coordinator.Membership` (who is a
live worker), :class:`~src.ps.state.decoding.ModelLayout` (checking and decoding pushes),
:class:`~src.ps.server.updates.Updates` (the barrier, the async apply, each step's learning rate),
:class:`~src.ps.server.control.ServerControl` (the controller's Control and the staleness policy),
:class:`~src.ps.state.replies.Replies` (the downlink replies), :class:`~src.ps.server.totals.RunTotals` (counters
and the run summary), :class:`~src.ps.server.evaluation.ServerEvaluations` and
:class:`~src.ps.server.checkpoints.ServerCheckpoints`; it keeps the calls its drivers make and what ties
them together (failures, the end of the run).

Learning rate: the update that makes version ``v + 1`` steps at ``training.lr_schedule``'s rate for
``v`` (:mod:`src.training.lr_schedule`; a resumed server continues it), unless its pushes carry the rate of
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
Time comes from the injected :class:`~src.common.clock.Clock`; evaluations run on the injected executor
(a background thread for real servers, inline in a simulation); injected faults call ``fire_fault``.
Pull and Push replies are ``bytes`` joined under the lock, or (``reply_views``, the real servers)
:class:`~src.transport.wire.Pieces` over the parameters' own memory that the transport sends or joins outside
the lock, copied only if the next step comes while a reply is still being sent
(:class:`~src.transport.wire.SharedBuffers`); a retried push is then answered with its verdict and work and,
when the model moved on without keeping the first reply's bytes, the newest parameters.

Outputs under ``system.log_dir/server``: ``events.jsonl`` (register, push, update with the sample
indices it applied, worker_failed, work_reassigned, eval, checkpoint, ...) and TensorBoard scalars;
checkpoints in ``system.checkpoint_dir`` every ``training.checkpoint_interval`` versions (written
before the next update, so a server killed at any moment loses fewer than that many versions; a
failed write ends the run with an error) and ``parameter_server_final.pt``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Callable

from torch import nn

from src import parameter_server_pb2 as pb
from src.common.checkpoint import final_checkpoint_path
from src.common.clock import REAL_CLOCK, Clock
from src.common.faults import FaultInjector, FaultSpec
from src.common.sessions import SessionSigner
from src.config import Config, SetupError
from src.coordinator import Batch, Member, Membership, MembershipError
from src.emulation import netem
from src.metrics import MetricsLogger, write_summary
from src.ps.server.checkpoints import ServerCheckpoints, model_from_checkpoint
from src.ps.server.control import ServerControl
from src.ps.server.dedup import Pushes
from src.ps.server.evaluation import ServerEvaluations
from src.ps.server.members import Workers
from src.ps.server.totals import RunTotals, emulation_summary
from src.ps.server.updates import Updates
from src.ps.server.work_source import WorkRefused, WorkSource
from src.ps.shards.shard_zero import Sharding
from src.ps.state.aggregation import Contribution, RequestLog
from src.ps.state.refusals import MEMBERSHIP_CODES, RunFailed
from src.ps.state.served_model import ServedModel
from src.ps.state.slice_pipeline import SlicePipeline, slice_elements_of
from src.ps.state.staleness import StalenessPolicy
from src.telemetry import tracing
from src.telemetry.trackers import open_trackers
from src.transport.errors import PushRefused, Refused
from src.transport.sinks import Sink
from src.transport.wire import Pieces, Received, split


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
        clock: where time comes from (:mod:`src.common.clock`).
        background: runs evaluations (default: inline; a real server passes a one-thread pool).
        reply_views: Pull and Push replies are :class:`~src.transport.wire.Pieces` over the tensors themselves
            (:class:`~src.transport.wire.SharedBuffers`: copied only if the model changes while a reply is still being
            sent), for a transport that sends them outside the lock without joining them; each comes with a
            lease the sender gives back (:meth:`Pieces.release <src.transport.wire.Pieces.release>`). Default: ``bytes``
            joined under the lock.
        events_after_replies: a push's ``push`` and ``update`` events are recorded under the lock and
            written by :meth:`flush_events`, which the driver calls once the push's reply is on its way
            (a killed server may lose the events of replies it had just sent). Default: written at once.
        sharding: serve shard 0 of a sharded server (:class:`~src.ps.shards.shard_zero.Sharding`): its part of
        ``model``,
            signed sessions every shard checks, pushes held then committed, a certificate per sync version
            (:mod:`src.ps.shards.rounds`). Default: the whole model.
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
        events_after_replies: bool = False,
        sharding: Sharding | None = None,
    ):
        self.config = config
        self.sharding = sharding
        self.pipeline: SlicePipeline | None = None
        """system.pipelined_replies: provisional slices (:mod:`src.ps.state.slice_pipeline`), once a model is served."""
        self._held: dict[int, Contribution] = {}  # sharded: pushes held until their commit, by worker
        self._events_after_replies = events_after_replies
        t, system = config.training, config.system
        self.clock = clock
        self.mode = system.aggregation_mode
        self.num_workers = system.num_workers
        self.work = work
        # Adaptive compression (src/adaptive/controller.py): fed this server's push and eval events; its decisions
        # go to the workers in every reply's Control and set the staleness policy's S_max.
        self.control = ServerControl(config, staleness_policy)
        if (
            self.control.controller is not None
            and test_set is not None
            and not (t.eval_interval or t.eval_every_samples)
        ):
            raise SetupError(
                "system.adaptive_compression decides at evaluations: set training.eval_interval "
                "(server versions between evaluations) or training.eval_every_samples"
            )
        netem.check_workers(config.emulation, self.num_workers)
        self.model = ServedModel(config, reply_views=reply_views)
        self.lock = threading.Condition()  # re-entrant: an inline evaluation decides under the caller's lock
        refusal = sharding.refusal(config, model, test_set) if sharding is not None else None
        if refusal is not None:
            raise SetupError(refusal)
        signer = SessionSigner(sharding.key) if sharding is not None else None
        self.members = Membership(self.num_workers, system.heartbeat_timeout, clock=clock.monotonic, signer=signer)
        self.requests = RequestLog()
        self.stopping = False
        self.fatal: BaseException | None = None
        self.fatal_code = "INTERNAL"
        """What a waiting call is refused with once the run has failed (UNAVAILABLE: a server is starting again)."""
        self.done = threading.Event()
        self.totals = RunTotals(clock, t.target_accuracy)
        self.counters = self.totals.counters
        self._faults = FaultInjector(system.inject_faults, "server", enabled=faults)
        self._fire_fault = fire_fault
        self.log = MetricsLogger(
            Path(system.log_dir) / "server",
            tensorboard=tensorboard and "tensorboard" in config.metrics.trackers,
            sinks=open_trackers(config, system.log_dir, resume=resume is not None),
            role="server",
            clock=clock.time,
        )
        self._make_collaborators(test_set, background, model_label or t.model_architecture, data_label or t.dataset)
        if model is not None:
            self._install_model(sharding.part(model) if sharding is not None else model)
        else:
            self.model.warm_up()
        self.resumed_from: Path | None = self._restore(resume) if resume is not None else None
        if sharding is not None and self.resumed_from is None:  # version 0: a point every shard can go back to
            failed = self.checkpoints.write_numbered(0, self.checkpoints.capture())
            if failed is not None:
                raise failed
        self.log.event(
            "run_start",
            architecture="parameter_server",
            config=config.to_dict(),
            clock=clock.kind,
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            version=self.version,
            **({"placement": sharding.placement.describe()} if sharding is not None else {}),
        )

    def _make_collaborators(self, test_set: Any, background: Executor | None, model_label: str, data_label: str):
        """The collaborators that share the run state made in ``__init__``."""
        config, control, shared = self.config, self.control, {"totals": self.totals, "log": self.log}
        self.evaluations = ServerEvaluations(
            config, test_set, control=control, lock=self.lock, background=background, on_failure=self._failed, **shared
        )
        parts = {"model": self.model, "work": self.work, "requests": self.requests, "members": self.members}
        self.checkpoints = ServerCheckpoints(
            config, model_label=model_label, data_label=data_label, control=control, **parts, **shared
        )
        self.updates = Updates(
            config,
            control=control,
            on_update=self._after_update,
            check_done=self._check_done,
            events_later=self._events_after_replies,
            certify=self.sharding.certify if self.sharding is not None else None,
            **parts,
            **shared,
        )
        self.pushes = Pushes(model=self.model, requests=self.requests, work=self.work, control=control, **shared)
        self.workers = Workers(
            config, updates=self.updates, lock=self.lock, check_done=self._check_done, **parts, **shared
        )

    def _install_model(self, model: nn.Module) -> None:
        """Serve ``model`` (at construction, or lock held): the learning rate of its first step is set."""
        self.model.install(model)
        self.evaluations.install(model)
        self.updates.schedule_next_step()
        if self.config.system.pipelined_replies:
            self.pipeline = SlicePipeline(self.state, slice_elements_of(self.config.system.pipeline_slice_bytes))
            self.updates.pipeline = self.pipeline

    def flush_events(self) -> None:
        """Write the events recorded for replies now on their way (``events_after_replies``); no lock needed."""
        self.log.flush()

    # The served model, for drivers, benchmarks and tests.
    state = property(lambda self: self.model.state, doc="The parameters and optimizer (``None``: no model yet).")
    version = property(lambda self: self.model.version, doc="The Server Version (0 while there is no model yet).")
    downlink = property(lambda self: self.model.downlink)
    replies = property(lambda self: self.model.replies)
    param_specs = property(lambda self: self.model.param_specs)
    max_message_bytes = property(lambda self: self.model.max_message_bytes)

    # ------------------------------------------------------------------------- calls (lock held)

    def register(self, request: pb.RegisterRequest, peer: str) -> tuple[pb.RegisterReply, list]:
        """A new incarnation of a worker id; returns the reply and the events to publish (a replaced incarnation)."""
        return self.workers.register(request, peer)

    def initialize(self, data) -> pb.InitializeReply:
        """A worker offers its model (layout and initial values) to a server that has none."""
        try:
            received = split(data, pb.InitializeRequest, ("parameters", "buffers"))
        except ValueError as exc:
            raise Refused("INVALID_ARGUMENT", f"initialize: {exc}") from None
        member = self.member(received.message.caller)
        model = self.model.offered(member.worker_id, received)
        if model is None:
            return pb.InitializeReply(accepted=False, version=self.state.version)
        self._install_model(model)
        self.lock.notify_all()
        self.log.event(
            "model_initialized",
            worker=member.worker_id,
            incarnation=member.incarnation,
            parameters=len(received.message.parameter_specs),
            buffers=len(received.message.buffer_specs),
            numel=sum(p.numel() for p in self.state.params),
        )
        return pb.InitializeReply(accepted=True, version=0)

    def begin_pull(self, caller: pb.Caller) -> Member:
        """A Pull: the caller is ready (sync rounds wait for ready workers); then wait for :meth:`poll_work`."""
        member = self.member(caller)
        self.model.require()
        if not member.ready:
            member.ready = True
            self.updates.maybe_start()
            self.lock.notify_all()  # a round it opened has work for the pulls already waiting
        return member

    def pull_reply(self, member: Member, work: tuple[list[Batch] | None, bool]) -> bytes | Pieces:
        """The serialized Pull reply: dense parameters (a pull starts the worker afresh) and ``work``."""
        self.downlink.forget(member.worker_id)
        message = pb.PullReply(version=self.state.version, work=self.work.message(*work), control=self.control.control)
        if self.sharding is not None and self.config.system.aggregation_mode == "async":
            message.certificate = self.updates.certificate  # the followers catch up (and drop a momentum) first
        with tracing.span("reply", worker=member.worker_id):
            return self.replies.serialize(message, member.worker_id)

    def begin_push(self, caller: pb.Caller, request: pb.PushRequest) -> Member | bytes | Pieces | object:
        """Admit a push: its member, or the stored reply of a retried push, or ``RequestLog.IN_PROGRESS``
        while the first copy of this request is still being handled (wait, then call again).

        On a member, the request is in progress until :meth:`push_reply` or :meth:`abandon`.
        """
        member = self.member(caller)
        self.model.require()
        return self.pushes.admit(member, request)

    def decode(self, worker_id: int, received: Received) -> Contribution | None:
        """Check and decompress a push's tensors (no lock needed); raises :class:`Refused` naming the problem.
        ``None`` for a sharded server's commit (it carries none: :meth:`apply_push` takes the held push)."""
        request = received.message
        if self.sharding is not None or request.hold or request.commit:
            Sharding.check_push(self.sharding, request)
            if request.commit:
                return None
        with tracing.span("decode", worker=worker_id, request_id=request.request_id):
            return self.model.layout.decode(worker_id, received, owns_data=self.work.owns_data)

    def hold(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> bytes:
        """A sharded server: hold a decoded push (``PushRequest.hold``) until its commit; the acknowledgement.

        Its batches must be the worker's work, as any push's; it joins the barrier only when committed
        (:mod:`src.ps.shards.rounds`), and a later hold of the same worker replaces it.
        """
        try:
            self.work.check_covers(member.worker_id, request)
        except WorkRefused as exc:
            raise PushRefused(exc.code, exc.message) from None
        self._held[member.worker_id] = contribution
        return pb.PushReply(accepted=True, version=self.version).SerializeToString()

    def apply_push(self, member: Member, request: pb.PushRequest, contribution: Contribution | None) -> pb.PushReply:
        """Add the decoded push to the barrier (sync) or apply it with its staleness weight (async): the verdict.
        A sharded server's commit (``contribution`` ``None``) adds the push it holds under the same request id."""
        if request.commit:
            self.sharding.check_staleness(request, self.config.system.aggregation_mode)
            contribution = self._committed(member.worker_id, request)
        verdict = self.updates.apply(member, request, contribution)
        self.lock.notify_all()
        return verdict

    def _committed(self, worker: int, request: pb.PushRequest) -> Contribution:
        held = self._held.get(worker)
        if held is None or held.request_id != request.request_id:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"commit of push {request.request_id} of worker {worker}, which this shard does not hold "
                f"(send it with hold=true to every shard first)",
            )
        if held.num_samples != request.num_samples:
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"commit of push {request.request_id} of worker {worker}: num_samples {request.num_samples}, "
                f"the held push has {held.num_samples}",
            )
        return self._held.pop(worker)

    def push_reply(
        self,
        member: Member,
        request_id: int,
        verdict: pb.PushReply,
        work: tuple[list[Batch] | None, bool],
        sink: Sink | None = None,
    ) -> bytes | Pieces:
        """The serialized Push reply (verdict, parameters, ``work``), remembered for retries of ``request_id``.
        A sharded server's: the newest version's certificate instead of the parameters (the worker pulls
        every shard's). ``sink``: the connection it goes on, whose confirmed provisional slices it leaves out
        (``system.pipelined_replies``)."""
        if self.sharding is not None:
            verdict.certificate = self.updates.certificate
        omit = self._omitted(sink) if self.sharding is None else []  # sharded: the pull carries the parameters
        reply = self.pushes.reply(member, request_id, verdict, work, parameters=self.sharding is None, omit=omit)
        self.lock.notify_all()
        return reply

    def _omitted(self, sink: Sink | None) -> list[int]:
        """The parameters a reply on ``sink`` leaves out (``system.pipelined_replies``); logs voided slices."""
        return self.pipeline.omitted_logged(sink, self.log) if self.pipeline is not None else []

    def parameters(self, member: Member, sink: Sink | None = None) -> bytes | Pieces:
        """A sharded server's ``PullRequest.parameters_only``: this shard's parameters at its version, no work.
        ``sink``: the connection it goes on, whose confirmed provisional slices it leaves out
        (``system.pipelined_replies``: sent during the worker's hold)."""
        with tracing.span("reply", worker=member.worker_id):
            omit = self._omitted(sink)
            message = pb.PullReply(version=self.version, provisional=omit)
            return self.replies.serialize(message, member.worker_id, omit=omit)

    def abandon(self, worker_id: int, request_id: int) -> None:
        """A push ended without a reply (refused, or its caller gone): a retry is handled afresh."""
        self.pushes.abandon(worker_id, request_id)
        self.lock.notify_all()

    def refused(self, worker_id: int | None, request_id: int, refused: PushRefused) -> None:
        """Count and log a refused push (the driver then refuses the call)."""
        self.pushes.refused(worker_id, request_id, refused)

    def heartbeat(self, caller: pb.Caller, stats: pb.WorkerStats) -> pb.HeartbeatReply:
        """A worker is alive: its totals so far."""
        self.totals.record_stats(self.member(caller), stats, final=False)
        return pb.HeartbeatReply(version=self.version)

    def finish(self, caller: pb.Caller, stats: pb.WorkerStats) -> pb.FinishReply:
        """A worker leaves (planned work: only once the run is finished) with its totals for the summary."""
        return self.workers.finish(caller, stats)

    def status(self) -> pb.StatusReply:
        """Who registered and finished, every incarnation's state, the totals so far."""
        return self.workers.status(done=self.done.is_set())

    def expire(self) -> list:
        """Fail every worker silent for longer than ``heartbeat_timeout``; returns the events to publish."""
        return self.workers.expire()

    def stop(self) -> None:
        """Waiting calls end (:meth:`poll_work` refuses with UNAVAILABLE)."""
        self.stopping = True
        self.lock.notify_all()

    # ------------------------------------------------------------------------- checks and waits (lock held)

    def member(self, caller: pb.Caller) -> Member:
        """The live member behind ``caller``, marked as seen; refuses the call otherwise."""
        return self.workers.member(caller)

    def poll_work(self, member: Member) -> tuple[list[Batch] | None, bool] | None:
        """``member``'s work for its reply, if there is some now: ``(batches, finished)``; ``None``: wait.

        Raises:
            Refused: the member is no longer live, the run failed, or the server is stopping.
        """
        self.check_waiting(member)
        worker = member.worker_id
        delivered = self.updates.deliver(worker)
        if delivered is not None:
            return delivered
        if self.mode == "async":
            batches = self.work.next_for(worker, self.members.live())
            if batches is not None:
                self.totals.training_clock_starts()
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
            raise Refused(self.fatal_code, f"the server stopped the run: {self.fatal}")

    # ------------------------------------------------------------------------- what follows an update; the end

    def _check_done(self) -> None:
        """The run is over when the work source says so (nothing left to do, no live worker)."""
        if self.work.over(self.members):
            self.totals.training_clock_stops()
            self.done.set()
            self.lock.notify_all()

    def _after_update(self, version: int, epochs_done: list[int], samples_before: int) -> None:
        """What follows an update: a checkpoint, an evaluation, a due fault, maybe the end of the run."""
        if version % self.config.training.checkpoint_interval == 0:
            # Written before any further update (lock held): a server killed at any moment loses fewer than
            # checkpoint_interval versions. A background write could be overtaken by the next checkpoint.
            failed = self.checkpoints.write_numbered(version, self.checkpoints.capture())
            if failed is not None:
                self._stop_run(failed)
        samples = self.counters["samples_applied"]
        if self.evaluations.due(version, epochs_done, samples_before, samples):
            epoch = self.work.epochs_done()
            self.evaluations.submit(epoch, version, self.state.snapshot(), self.totals.elapsed(), samples)
        self._faults.reached(
            version,
            announce=lambda fault: self.log.event("fault_injected", fault=str(fault), version=version),
            fire=self._fire_fault,
        )
        if self.work.finished():
            self.totals.training_clock_stops()
        self._check_done()

    def stop_run(self, error: BaseException, *, code: str = "INTERNAL") -> None:
        """End the run with ``error`` from outside (a driver's watch: another shard went away); waiting calls are
        refused with ``code`` (UNAVAILABLE: the shards start again, and the workers register again, as after any
        server restart)."""
        self.fatal_code = code
        self._stop_run(error)

    def _stop_run(self, error: BaseException) -> None:
        """The run ends with ``error``: waiting calls are refused, the driver's wait ends."""
        self.fatal = error
        self.done.set()
        with self.lock:
            self.lock.notify_all()

    def _failed(self, error: BaseException) -> None:
        """A background evaluation failed: the run ends with its error (unless it ended already)."""
        if self.fatal is None:
            self._stop_run(error)

    def _restore(self, target: str | Path) -> Path:
        """Continue from a checkpoint of this run's server (strictly: it must be one); returns its path."""
        path, checkpoint = self.checkpoints.load(target)
        if self.state is None:  # a server that takes its model from a worker: the checkpoint holds it
            self._install_model(model_from_checkpoint(path, checkpoint))
        self.checkpoints.restore(checkpoint)
        self.updates.schedule_next_step()  # the schedule goes on from the checkpoint's version
        self.checkpoints.recovered(path, self.state.version)
        return path

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
        self.evaluations.drain()  # let a pending checkpoint or evaluation finish first
        if self.fatal is not None:
            raise RunFailed(str(self.fatal)) from self.fatal
        if self.state is None:
            raise RunFailed("the run ended before any worker sent its model (Initialize)")
        system = self.config.system
        with self.lock:
            state = self.checkpoints.capture()
            workers = self.totals.workers()
        train_time = self.totals.train_time()
        samples = self.counters["samples_applied"]
        final_loss, final_accuracy = self.evaluations.final(state["version"], self.state.model, train_time, samples)
        checkpoint_path = self.checkpoints.write(
            final_checkpoint_path(system.checkpoint_dir, "parameter_server"), state
        )
        if system.gradient_ledger:
            self.updates.save_ledger(Path(system.log_dir) / "server" / "gradient_ledger.pt")
        summary = self.totals.summary(
            self.config,
            data_label=self.checkpoints.data_label,
            final_loss=final_loss,
            final_accuracy=final_accuracy,
            checkpoint_path=str(checkpoint_path),
            versions=state["version"],
            train_time=train_time,
            workers=workers,
            controller=self.control.summary(),
            emulation=emulation_summary(self.config, downlink_delay_s),
        )
        summary.update(extra or {})
        if self.work.owns_data:
            summary["steps_skipped"] = self.counters["steps_skipped"]
        if self.pipeline is not None:  # system.pipelined_replies: what went back before the barriers
            summary["pipelined_replies"] = dict(self.pipeline.counts)
        self.log.event("run_end", **{k: v for k, v in summary.items() if k != "workers"})
        summary_path = write_summary(summary_json or Path(system.log_dir) / "summary.json", summary)
        self.log.finish(summary, artifacts=[summary_path, checkpoint_path])
        return summary

    def close(self) -> None:
        """Wait for background work and close the event log."""
        self.evaluations.close()
        self.log.close()
