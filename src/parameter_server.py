"""The parameter server: a driver of the server core (:mod:`src.ps.server.core`) over real connections.

Everything the server decides (membership, the work plan, the sync barrier and async apply,
staleness, the controller, the downlink, de-dup, checkpoints, events and the summary) is in
:class:`~src.ps.server.core.ServerCore`; this module adds what a real network service needs, once for
every transport (``system.transport``):

* the calls (``handle_register``, ``handle_push``, ...): each takes the core's lock, calls the core,
  and lets a :class:`~src.ps.state.refusals.Refused` out for the transport to turn into its own error with the
  same status name. The transports are thin: gRPC (:func:`~src.transport.grpc.service_handler`, the
  ``Register``/``Push``/... methods of :class:`~src.transport.grpc_service.GrpcMethods`) and binary frames over TCP
  (:mod:`src.transport.tcp_server`);
* the waits: a Pull or Push whose work is not there yet (the sync barrier, or nothing unassigned)
  waits on the core's lock, waking every :data:`WAIT_POLL_S` to notice a call whose client went away;
* push decoding outside the lock, so pushes of different workers decode in parallel, and replies
  built as views of the parameters (:class:`~src.transport.wire.SharedBuffers`) that are joined (gRPC) or
  written to the socket (TCP) outside it;
* the heartbeat monitor thread (failure detection lands within ``heartbeat_timeout`` + :data:`MONITOR_PERIOD_S`);
* evaluations on a background thread, off the critical path of the pushes;
* emulated downlinks (:mod:`src.emulation.netem`, the config's ``emulation`` section): a Pull or Push reply to
  a worker with a narrow downlink waits its transfer time (from its exact size on the wire, the
  transport's framing included) after it is built, outside the lock, before it is sent.

Timeline spans (``--trace``, :mod:`src.telemetry.tracing`): ``serve_push`` / ``serve_pull`` per RPC, with
``barrier_wait`` (the call waiting for its work), ``downlink_wait`` (emulated) and the core's
``decode``, ``apply``, ``reply``, ``evaluate`` and ``checkpoint`` inside.

Use: :meth:`ParameterServer.start` -> workers train -> :meth:`~ParameterServer.wait_until_done` ->
:meth:`~ParameterServer.finalize` -> :meth:`~ParameterServer.stop`.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable

from torch import nn

from src import parameter_server_pb2 as pb
from src.config import Config, SetupError
from src.coordinator import WorkPlan
from src.emulation import netem
from src.ps.server.core import ServerCore
from src.ps.server.work_source import PlannedWork, WorkSource
from src.ps.shards.shard_zero import Sharding
from src.ps.state.aggregation import RequestLog
from src.ps.state.decoding import arriving_push_splitter
from src.ps.state.refusals import RunFailed
from src.ps.state.staleness import StalenessPolicy
from src.ps.state.streamed_parts import PushParts, arrived_push, push_size
from src.telemetry import tracing
from src.trainer import load_split, model_from_config
from src.transport.errors import PushRefused, Refused
from src.transport.grpc import start_grpc_server
from src.transport.grpc_service import PUSH_LARGE_FIELDS, Call, GrpcMethods
from src.transport.settings import require_auth_token
from src.transport.sinks import Sink
from src.transport.wire import MessageSplitter, Pieces

WAIT_POLL_S = 0.5  # a waiting call wakes this often to notice a cancelled RPC
MONITOR_PERIOD_S = 0.2  # failure detection runs this often: detection lands within timeout + this


def planned_work(config: Config, num_train_samples: int | None = None) -> PlannedWork:
    """The dataset's work plan for ``config`` (the training set is loaded to size it unless given)."""
    t, system = config.training, config.system
    if num_train_samples is None:
        num_train_samples = len(load_split(config, "train"))
    return PlannedWork(
        WorkPlan(
            num_train_samples,
            system.num_workers,
            t.batch_size,
            t.num_epochs,
            t.seed,
            system.aggregation_mode,
            batches_per_step=system.local_steps,
        )
    )


def test_set_for(config: Config):
    """The test split a server evaluates on."""
    return load_split(config, "test")


class ParameterServer(GrpcMethods):
    """A :class:`~src.ps.server.core.ServerCore` served over gRPC or TCP (see the module docstring).

    Args:
        config: the run's config (mode, workers, optimizer, heartbeats, outputs).
        token: the auth token every RPC must carry (default: :func:`require_auth_token`).
        model: a model to serve instead of ``model_from_config(config)`` (benchmarks).
        num_train_samples: training-set size (default: loaded from the config's dataset).
        staleness_policy: async weight-or-reject policy (default ``StalenessPolicy.from_config(config.system)``).
        evaluate: evaluate on the test split (every ``eval_interval`` versions, at epoch ends, at the end).
        tensorboard: also write TensorBoard scalars next to ``events.jsonl``.
        resume: a checkpoint file or folder of an earlier server of this run to continue from.
        faults: fire the config's ``kill:server@version=N`` faults (``False`` in a restarted server).
        on_event: called (outside the lock) with ``(kind, fields)`` for events a launcher acts on
            (``worker_failed``).
        work: where work comes from (default: the dataset's plan); see :mod:`src.ps.server.work_source`.
        model_label, data_label: what checkpoints and summaries call the model and the data.
        max_message_bytes: the message limit while the model's size is not known yet (a server without a model).
        transport: ``"grpc"`` or ``"tcp"`` (default ``system.transport``).
        sharding: serve shard 0 of a sharded server (:class:`~src.ps.shards.shard_zero.Sharding`; default: the run's own
            when ``system.num_servers`` > 1). It does not evaluate: shard 0 holds a part of the model.
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
        work: WorkSource | None = None,
        serve_without_model: bool = False,
        model_label: str | None = None,
        data_label: str | None = None,
        max_message_bytes: int | None = None,
        transport: str | None = None,
        sharding: Sharding | None = None,
    ):
        self.config = config
        self.evaluate = evaluate
        self.transport = transport or config.system.transport
        self.token = token or require_auth_token(config.system)
        self.on_event = on_event
        if model is None and not serve_without_model:
            model = model_from_config(config)
        if sharding is None and config.system.num_servers > 1:
            if model is None:
                raise SetupError(
                    "system.num_servers > 1: a sharded server needs its model at start (a worker's Initialize is "
                    "not sharded; the library's server: --model package.module:function)"
                )
            sharding = Sharding.of_run(model, config.system, self.token)
        if sharding is not None:
            conditions = [netem.conditions_for(config.emulation, k) for k in range(config.system.num_workers)]
            linked = [k for k, c in enumerate(conditions) if c.uplink is not None or c.downlink is not None]
            if linked:
                raise SetupError(
                    f"emulation: workers {linked} have emulated links, which a sharded real run would emulate once per "
                    f"shard connection (a worker's one link S times over): use --clock virtual, or tc in namespaces"
                )
        self.core = ServerCore(
            config,
            work=work or planned_work(config, num_train_samples),
            model=model,
            model_label=model_label,
            data_label=data_label,
            test_set=test_set_for(config) if evaluate and sharding is None else None,
            staleness_policy=staleness_policy,
            tensorboard=tensorboard,
            resume=resume,
            faults=faults,
            background=ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-background"),
            reply_views=True,  # replies are built from the tensors' memory and joined or sent outside the lock
            events_after_replies=True,  # a push's events are written once its reply is out (after_reply)
            sharding=sharding,
        )
        if max_message_bytes is not None and self.core.state is None:
            self.core.model.max_message_bytes = max_message_bytes
        self.downlinks = {
            k: netem.link_or_none(netem.conditions_for(config.emulation, k).downlink)
            for k in range(config.system.num_workers)
        }  # emulated server -> worker links
        self.instance = secrets.token_bytes(8)  # random per process: the other shards notice a restart by it
        self.resume_version: int | None = None  # a sharded server started again: the version every shard goes to
        self.agreed_instances: list[bytes] = []  # ... chosen with these followers (src/ps/shards/recovery.py)
        self.load = pb.ShardLoad()  # the bytes of the Pull and Push messages in and out (update_s: a shard's)
        self._load_lock = threading.Lock()
        self._stop_serving: Callable[[float], None] | None = None
        self.transport_server: Any = None  # the grpc.Server or src.transport.tcp_server.TCPServer, once started
        self._monitor: threading.Thread | None = None
        self.port: int | None = None

    # The run state, for launchers, benchmarks and tests.
    state = property(lambda self: self.core.state)
    version = property(lambda self: self.core.version)
    members = property(lambda self: self.core.members)
    counters = property(lambda self: self.core.counters)
    downlink = property(lambda self: self.core.downlink)
    param_specs = property(lambda self: self.core.param_specs)
    log = property(lambda self: self.core.log)

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> int:
        """Serve on ``system.server_address`` over ``transport`` and start failure detection; returns the bound port."""
        self.core.model.serving = True
        system = self.config.system
        max_calls = 3 * system.num_workers + 8  # per worker: a waiting push, a heartbeat, a spare
        if self.transport == "tcp":
            from src.transport.tcp_server import TCPServer

            tcp = TCPServer(
                self, system, token=self.token, max_message_bytes=self.core.max_message_bytes, max_connections=max_calls
            )
            self.port = tcp.start()
            self._stop_serving = tcp.stop
            self.transport_server = tcp
        else:
            grpc_server, self.port = start_grpc_server(
                self, system, token=self.token, max_message_bytes=self.core.max_message_bytes, max_threads=max_calls
            )
            self._stop_serving = lambda grace: grpc_server.stop(grace).wait()
            self.transport_server = grpc_server
        self._monitor = threading.Thread(target=self._watch_heartbeats, name="ps-heartbeat-monitor", daemon=True)
        self._monitor.start()
        self.core.log.event("listening", address=system.server_address, port=self.port, transport=self.transport)
        return self.port

    def wait_until_done(self, timeout: float | None = None) -> bool:
        """Block until the run is over: every batch applied and every live worker finished (or ``timeout``).

        Raises:
            RunFailed: a background checkpoint or evaluation failed.
        """
        finished = self.core.done.wait(timeout)
        if self.core.fatal is not None:
            raise RunFailed(str(self.core.fatal)) from self.core.fatal
        return finished

    def finalize(self, summary_json: str | Path | None = None) -> dict[str, Any]:
        """Final evaluation, final checkpoint and run summary (see :meth:`ServerCore.finalize`); a sharded server's
        final checkpoint is the whole model, read from every shard (:meth:`_whole_model`)."""
        waited = {k: link.delay_s for k, link in self.downlinks.items() if link is not None}
        summary = self.core.finalize(summary_json, downlink_delay_s=waited)
        if self.core.sharding is not None:
            summary = self._whole_model(summary, summary_json)
        return summary

    def fresh_model(self) -> nn.Module:
        """A new instance of the served model (its names and shapes): the config's."""
        return model_from_config(self.config)

    def _own_load(self) -> pb.ShardLoad:
        """Shard 0's load: its messages' bytes and its optimizer's seconds."""
        with self._load_lock:
            load = pb.ShardLoad()
            load.CopyFrom(self.load)
        load.update_s = self.core.updates.step_s
        return load

    def _whole_model(self, summary: dict[str, Any], summary_json: str | Path | None) -> dict[str, Any]:
        """Shard 0 of a sharded run, at its end: read the other shards' parts (:mod:`src.ps.shards.final`), put the
        whole model into the final checkpoint, evaluate it, and say so in the summary (written again) with every
        shard's load."""
        from src.ps.shards.final import collect_parts, reader_session, whole_model_summary
        from src.transport.clients import make_client

        system, placement = self.config.system, self.core.sharding.placement
        if len(system.shard_addresses) != system.num_servers:
            raise RunFailed(
                f"system.shard_addresses: shard 0 reads the other {system.num_servers - 1} shards' parts from their "
                f"addresses, and has {len(system.shard_addresses)}"
            )
        caller, certificate, version = reader_session(self.core)
        clients = [
            make_client(address, transport=self.transport, token=self.token, system=system, connect_timeout_s=30)
            for address in system.shard_addresses[1:]
        ]
        try:
            # the loads first: a follower stops once its part is read (PullRequest.final)
            loads = [self._own_load(), *(client.status(timeout=30).load for client in clients)]
            parts = collect_parts(clients, caller, certificate, version, placement)
        finally:
            for client in clients:
                client.close()
        return whole_model_summary(
            summary,
            core=self.core,
            model=self.fresh_model(),  # the names and shapes the parts go back into
            placement=placement,
            parts=parts,
            loads=loads,
            test_set=test_set_for(self.config) if self.evaluate else None,
            summary_path=summary_json or Path(system.log_dir) / "summary.json",
        )

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving: waiting calls return, then the transport's server shuts down."""
        with self.core.lock:
            self.core.stop()
        if self._stop_serving is not None:
            self._stop_serving(grace)
        if self._monitor is not None:
            self._monitor.join(5)
        self.core.close()

    # ------------------------------------------------------------------------- calls (every transport)

    def handle_register(self, request: pb.RegisterRequest, peer: str) -> pb.RegisterReply:
        with self.core.lock:
            reply, events = self.core.register(request, peer)
        self._publish(events)
        return reply

    def handle_initialize(self, data) -> pb.InitializeReply:
        with self.core.lock:
            return self.core.initialize(data)

    def handle_pull(self, request: pb.PullRequest, call: Call) -> bytes | Pieces:
        with tracing.span("serve_pull", worker=request.caller.worker_id), self.core.lock:
            if request.parameters_only:  # a sharded server's worker, after its commit
                member = self.core.member(request.caller)
                reply = self.core.parameters(member, getattr(call, "sink", None))
            else:
                member = self.core.begin_pull(request.caller)
                reply = self.core.pull_reply(member, self._await_work(member, call))
        self._emulate_downlink(member.worker_id, len(reply) + call.framing_bytes)
        self._count(request.ByteSize(), len(reply))
        return reply

    def handle_push(self, data, call: Call) -> bytes | Pieces:
        with tracing.span("serve_push"):
            reply = self._serve_push(data, call)
        self._count(push_size(data), len(reply))
        return reply

    def sent_provisional(self, nbytes: int) -> None:
        """A transport wrote ``nbytes`` of provisional slices (``system.pipelined_replies``): counted as sent."""
        if nbytes:
            self._count(0, nbytes)

    def _count(self, bytes_in: int, bytes_out: int) -> None:
        """A call's message sizes, into this server's :attr:`load` (a sharded run's summary reports them)."""
        with self._load_lock:
            self.load.bytes_in += bytes_in
            self.load.bytes_out += bytes_out

    def push_splitter(self, data) -> MessageSplitter:
        """A splitter of a push arriving into ``data``, for a transport that reads it in pieces (TCP): each
        gradient is checked as its bytes come in and decoded as soon as it is whole, outside the lock
        (:class:`~src.ps.state.decoding.ArrivingPush`); pass the splitter to :meth:`handle_push` once every byte
        has arrived."""
        # the layout is fixed once installed; a push before Initialize is refused later
        return arriving_push_splitter(self.core.model.layout, data, PUSH_LARGE_FIELDS)

    def push_parts(self, max_bytes: int, sink: Sink | None = None) -> PushParts:
        """The parts of a streamed push about to arrive (:mod:`src.ps.state.streamed_parts`): each gradient checked and
        decoded as it comes, outside the lock; pass ``parts.assemble(message bytes)`` to :meth:`handle_push`.
        ``sink``: the connection's, with ``system.pipelined_replies`` (its dense values are reported as they
        arrive: :meth:`PushParts.progress <src.ps.state.streamed_parts.PushParts.progress>`)."""
        pipeline = self.core.pipeline
        arriving = None
        if pipeline is not None and sink is not None and sink.worker is not None:
            arriving = partial(pipeline.arrived, sink)
        return PushParts(self.core.model.layout, PUSH_LARGE_FIELDS, max_bytes, arriving=arriving)

    @property
    def pipelined(self) -> bool:
        """Whether provisional slices are sent (``system.pipelined_replies``): a transport then gives each
        connection a :class:`~src.ps.state.slice_pipeline.Sink`."""
        return self.core.config.system.pipelined_replies

    def _serve_push(self, data, call: Call) -> bytes | Pieces:
        core = self.core
        try:
            received = arrived_push(data, PUSH_LARGE_FIELDS)
        except ValueError as exc:
            self._refused(None, 0, PushRefused("INVALID_ARGUMENT", f"push: {exc}"))
        request = received.message
        worker_id, request_id = request.caller.worker_id, request.request_id
        if request.hold:
            return self._hold(received, getattr(call, "sink", None))
        try:
            with core.lock:
                admitted = core.begin_push(request.caller, request)
                while admitted is RequestLog.IN_PROGRESS:
                    core.lock.wait(WAIT_POLL_S)  # the first copy of this request is still being handled
                    admitted = core.begin_push(request.caller, request)
                if isinstance(admitted, (bytes, Pieces)):
                    return admitted  # a retry: answer again, apply nothing
                member = admitted
            sink = getattr(call, "sink", None)  # system.pipelined_replies: this connection's provisional slices
            if core.pipeline is not None and sink is not None:
                core.pipeline.attach(worker_id, sink)  # its next push's values are reported from here
            try:
                contribution = core.decode(worker_id, received)  # outside the lock: workers decode in parallel
                with core.lock:
                    core.member(request.caller)
                    verdict = core.apply_push(member, request, contribution)
                    reply = core.push_reply(member, request_id, verdict, self._await_work(member, call), sink)
            except BaseException:
                with core.lock:
                    core.abandon(worker_id, request_id)
                raise
        except PushRefused as refused:
            self._refused(worker_id, request_id, refused)
        self._emulate_downlink(worker_id, len(reply) + call.framing_bytes)
        return reply

    def _hold(self, received, sink: Sink | None) -> bytes:
        """A sharded server's held push (:meth:`ServerCore.hold <src.ps.server.core.ServerCore.hold>`): decoded outside
        the lock, acknowledged at once. ``sink``: the connection's, with ``system.pipelined_replies`` (its next hold's
        values are reported there, and the pull after it leaves out the slices confirmed)."""
        core, request = self.core, received.message
        worker_id = request.caller.worker_id
        try:
            with core.lock:
                core.member(request.caller)
            if core.pipeline is not None and sink is not None:
                core.pipeline.attach(worker_id, sink)
            contribution = core.decode(worker_id, received)
            with core.lock:
                return core.hold(core.member(request.caller), request, contribution)
        except PushRefused as refused:
            self._refused(worker_id, request.request_id, refused)

    def after_reply(self) -> None:
        """A call's reply is on its way: write the events its handling recorded (no lock held)."""
        self.core.flush_events()

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        with self.core.lock:
            return self.core.heartbeat(request.caller, request.stats)

    def handle_finish(self, request: pb.FinishRequest) -> pb.FinishReply:
        with self.core.lock:
            return self.core.finish(request.caller, request.stats)

    def handle_status(self) -> pb.StatusReply:
        with self.core.lock:
            status = self.core.status()
        if self.core.sharding is not None:  # what the other shards watch (src/ps/shards/recovery.py)
            status.instance = self.instance
            status.checkpoints.extend(self.checkpoint_versions())
            if self.resume_version is not None:
                status.resume_version = self.resume_version
                status.agreed_instances.extend(self.agreed_instances)
        return status

    def checkpoint_versions(self) -> list[int]:
        """The versions of this server's numbered checkpoints, newest first."""
        from src.common.checkpoint import numbered_checkpoints

        return [int(p.stem.rsplit("_", 1)[1]) for p in numbered_checkpoints(self.config.system.checkpoint_dir)]

    def fail(self, message: str) -> None:
        """End the run with ``message`` (another shard of a sharded run went away: :mod:`src.ps.shards.recovery`).
        The shards start again together, so a worker's waiting call is refused as after a server restart
        (UNAVAILABLE): it registers again rather than ending."""
        self.core.stop_run(RunFailed(message), code="UNAVAILABLE")

    # ------------------------------------------------------------------------- refusals and waits

    def _refused(self, worker_id: int | None, request_id: int, refused: PushRefused) -> None:
        """Count and log a refused push, then refuse the call (re-raises ``refused``)."""
        with self.core.lock:
            self.core.refused(worker_id, request_id, refused)
        raise refused

    def _await_work(self, member, call: Call):
        """Wait (lock held) until ``member`` has work to be told about, or the run is finished."""
        with tracing.span("barrier_wait", worker=member.worker_id):
            while True:
                work = self.core.poll_work(member)
                if work is not None:
                    return work
                self.core.lock.wait(WAIT_POLL_S)
                if not call.is_active():
                    raise Refused("CANCELLED", "call cancelled while waiting for work")

    def _watch_heartbeats(self) -> None:
        core = self.core
        while True:
            with core.lock:
                if core.stopping or core.done.is_set():
                    return
                events = core.expire()
            self._publish(events)
            core.flush_events()  # events a call recorded and no reply has written yet (none, unless a call died)
            time.sleep(MONITOR_PERIOD_S)

    def _publish(self, events: list) -> None:
        """Tell the launcher (outside the lock) about events it acts on."""
        if self.on_event is not None:
            for kind, fields in events:
                self.on_event(kind, fields)

    def _emulate_downlink(self, worker: int, nbytes: int) -> None:
        """Wait as long as ``nbytes`` of reply take on ``worker``'s downlink (no lock held: links are parallel)."""
        link = self.downlinks.get(worker)
        if link is not None:
            with tracing.span("downlink_wait", bytes=nbytes):
                link.transmit(nbytes)
