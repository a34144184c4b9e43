"""A simulated worker process of a virtual-time run: the real worker's protocol, driven by events.

:class:`VirtualWorker` sends the messages :class:`src.worker.Worker` sends (register, pull, push,
heartbeat, finish: the real protocol's bytes) to the simulated server
(:class:`~src.virtual.server.VirtualServer`) and does the real worker's step
(:class:`~src.ps.worker_step.WorkerStep`) on its real batches; only its timing comes from the cost
model: the step's compute seconds, then ``compress_s``, then the push. Injected faults kill, stop
(``hang``) or pause it at a step; a failed call is handled as the real worker does
(:func:`src.ps.worker_protocol.failed_call`: register again, or exit for the launcher to restart it).

With several server shards (``system.num_servers`` = S > 1) it does the real worker's sharded step
(``Worker._push_to_shards`` and ``Worker._pull_shards`` in :mod:`src.worker`; its messages built by
:mod:`src.ps.shard_step`): each shard's slices held on every shard at once, then, once every shard has
acknowledged, the commit to shard 0 (async: with the followers' staleness), whose reply carries the verdict, the
next work and the certificate, then every shard's slices pulled at once (the followers' with the certificate). Its
messages to different shards are in flight together and share its own links (:mod:`src.virtual.network`).

With ``system.streaming`` it does the real streamed worker's step (``Worker._train_step_streamed``,
:mod:`src.ps.worker_stream`), timed by :mod:`src.emulation.overlap` over the model's layers
(:mod:`src.virtual.layers`): the step's compute seconds spread over the layers; the forward waits, layer by layer, for
the tensors of the reply it computes from; backward hands each gradient over as its layer's segment ends (in the
order the real worker's hooks record), and its part (the payload :meth:`~src.ps.worker_step.WorkerStep.encode_part`
makes, the real worker's) goes on the worker's link as soon as it is encoded, the parts one after another; the push's
message follows after backward. The reply comes down in pieces: its head settles the step and starts the next, its
tensors arrive behind it. The step's exposed communication (``communication_time_s``, as the real streamed worker
reports it) is from the end of backward to the reply's head plus the forward's waits. The arithmetic is the
unstreamed step's: only when the bytes travel changes. With several shards each gradient's slices stream to the shards
holding them, each on the worker's connection to its shard, as the holds; the commit and the pulls follow as in the
unstreamed sharded step, and the pulls bring every slice before the step settles.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.utils.data import TensorDataset

from src import parameter_server_pb2 as pb
from src.common.clock import VirtualClock
from src.common.faults import FaultInjector, FaultSpec
from src.common.seeds import derive_seed
from src.common.supervisor import LaunchError
from src.config import Config
from src.emulation.cost_model import CostModel
from src.emulation.event_loop import EventLoop
from src.emulation.overlap import FifoLink, ForwardPass, encode_times, ready_offsets, split_step
from src.metrics import MetricsLogger
from src.ps.placement import Placement
from src.ps.worker_protocol import Failure, IncarnationRevoked, Rejoins, failed_call
from src.ps.worker_step import WorkerStep, check_layout
from src.transport.stream import SliceStage, part_pieces, part_size
from src.transport.wire import Outgoing, Received, chunk_size, serialize, split
from src.virtual.layers import GradientOrder, LayerProfile, reply_pieces
from src.virtual.timelines import VirtualTimelines

MODEL_STATE = ("parameters", "buffers")
REPLY_FIELDS = MODEL_STATE + ("parameter_deltas",)

Handler = Callable[[Any, bytes], None]
"""A server's handler of one message: the call it arrived on, and its bytes."""


class ShardCalls(Protocol):
    """What a simulated worker calls on every server shard (:class:`src.virtual.server.VirtualServer` and
    :class:`src.virtual.follower.VirtualFollower` are ones): Push (a sharded run's held push, or commit) and Pull."""

    serve_pull: Handler
    serve_push: Handler

    def call(
        self,
        worker: VirtualWorker,
        data: bytes,
        handle: Handler,
        on_reply: Callable[[bytes], None],
        on_error: Callable[[str, str], None],
        *,
        wait_for_server: bool = False,
        sent: Callable[[], None] | None = None,
    ) -> None: ...

    def send_part(self, worker: VirtualWorker, push: Any, body: bytes, sent: Callable[[], None]) -> None: ...

    def serve_streamed_push(self, push: Any) -> Handler: ...


class ServerCalls(ShardCalls, Protocol):
    """What a simulated worker calls on the simulated server (shard 0 of a sharded run; :class:`VirtualServer
    <src.virtual.server.VirtualServer>` is one): every call."""

    serve_register: Handler
    serve_heartbeat: Handler
    serve_finish: Handler


class ProcessEnds(Protocol):
    """What a simulated worker tells its launcher (:class:`src.virtual.launcher.VirtualLauncher` is one)."""

    def process_ended(self, worker: VirtualWorker, exit_description: str) -> None: ...


class WorkerRun(Protocol):
    """What a simulated worker reads from its run (:class:`src.virtual.run.VirtualRun` is one): the config, the
    clock and cost model, the shared compute model and data, the server and launcher it talks to, and with several
    server shards their placement and every shard (shard 0, the server, first; ``placement`` ``None``: one server)."""

    config: Config
    cost: CostModel
    loop: EventLoop
    clock: VirtualClock
    tensorboard: bool
    compute_wall_s: float
    timelines: VirtualTimelines
    compute_model: nn.Module
    train_set: TensorDataset
    server: ServerCalls
    launcher: ProcessEnds
    placement: Placement | None
    shards: list[ShardCalls]
    layers: LayerProfile | None
    gradient_order: GradientOrder | None


@dataclass
class StreamedStep:
    """A streamed step in progress (``system.streaming``): what its push and settling need once backward is over."""

    batches: list[pb.Batch]
    loss: float
    correct: int
    samples: int
    parts: list[tuple[int, int, Any]]  # (shard, index there, payload), in the order backward handed them over
    buffers: list
    started: float  # virtual seconds: the step's start (the previous reply's head)
    first_sent: float | None = None  # virtual seconds: the first part onto the link


@dataclass
class Traffic:
    """The bytes one sharded push moved: its messages to every shard, and their replies."""

    sent: int = 0
    received: int = 0


class VirtualWorker:
    """A simulated worker process: the real worker's protocol (:class:`src.worker.Worker`) driven by events.

    Its parameter replica (what the server last sent it) outlives its processes: a restarted process
    pulls into the same tensors.
    """

    def __init__(self, run: WorkerRun, worker_id: int):
        self.run = run
        self.worker_id = worker_id
        self.config = run.config
        self.process = 0
        self.alive = False
        self.hung = False
        self.pause_s: float | None = None  # a pause fault: how long until the stopped process runs again
        self.beating = 0  # the heartbeat chain that is current (a resumed process starts a new one)
        self.rejoins = Rejoins(worker_id, run.config.system.max_rejoins)
        self.last_failure: Failure | None = None
        self.finishing = False  # a Finish is on its way
        self.compress_s = run.cost.compress_s
        """What compressing the latest push cost (none for a push that went uncompressed)."""
        model = run.compute_model
        self.replica = (
            [torch.zeros_like(p) for p in model.parameters() if p.requires_grad],
            [torch.zeros_like(b) for b in model.buffers() if b.is_floating_point()],
        )
        self.step: WorkerStep | None = None
        self.log: MetricsLogger | None = None
        self.caller = pb.Caller(worker_id=worker_id)
        self.incarnation = 0
        self.bytes_sent = self.bytes_received = 0
        self.uplink_delay_s = self.compute_extra_s = 0.0
        self.started_at = 0.0
        self.step_started = 0.0  # virtual seconds: when the step now computing was handed its work
        # system.streaming: the reply tensors the next forward needs that have not arrived, the forward in progress,
        # the worker's connection to each server shard (parts, then the push's message, one after another on each;
        # the connections share the worker's link), streamed pushes so far, and what to do once the last reply's
        # tail is in (None: it is in)
        self.arriving: set = set()
        self.forward: ForwardPass | None = None
        self.uplinks: list[FifoLink] = []  # made when a process starts (the run's shards exist by then)
        self.pushes = 0
        self.after_tail: Callable[[], None] | None = None
        self.tail_pending = False
        # system.pipelined_replies: the provisional slices each connection brought this step, until the reply that
        # names them (made with the connections)
        self.stages: list[SliceStage] = []

    def _connect(self) -> None:
        """New connections to every server shard (one server: one): their lines up, and their slices down."""
        count = max(1, len(self.run.shards))
        self.uplinks = [FifoLink() for _ in range(count)]
        self.stages = [SliceStage() for _ in range(count)]

    @property
    def pid(self) -> int:
        """A process id unique to this worker's process number (what registration reports)."""
        return (self.worker_id + 1) * 10_000 + self.process

    def reachable(self, process: int) -> bool:
        """Whether a message for ``process`` still reaches a running, unstopped process."""
        return self.alive and not self.hung and self.process == process

    def _now(self) -> float:
        return self.run.clock.now

    # ------------------------------------------------------------------------- life

    def start(self, *, faults: bool) -> None:
        """A new process of this worker: register, then pull and train."""
        self.process += 1
        self.alive, self.hung, self.pause_s = True, False, None
        self.rejoins = Rejoins(self.worker_id, self.config.system.max_rejoins)  # a new process: a new budget
        self.step = None
        self.caller = pb.Caller(worker_id=self.worker_id)
        self.bytes_sent = self.bytes_received = 0
        self.uplink_delay_s = self.compute_extra_s = 0.0
        self.started_at = self._now()
        self.arriving, self.forward = set(), None  # a new process: nothing in flight
        self._connect()
        self.tail_pending, self.after_tail = False, None
        self.faults = FaultInjector(self.config.system.inject_faults, "worker", self.worker_id, enabled=faults)
        self._register(0, [], self._first_registration)

    def end(self, exit_description: str | None) -> None:
        """This process ends (``None``: it finished; otherwise how it died, for the launcher)."""
        if not self.alive:
            return
        self.alive = self.finishing = False
        self.close_log()
        if exit_description is not None:
            self.run.launcher.process_ended(self, exit_description)

    def close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def _fault(self, fault: FaultSpec) -> None:
        if fault.action == "kill":
            self.end("killed by SIGKILL")
        else:  # SIGSTOP: no more steps, no more heartbeats; the server will declare it failed
            self.hung = True
            self.pause_s = fault.seconds  # pause: it runs again that much later (hang: never)

    def _resumed(self, process: int, go_on: Callable[[], None]) -> None:
        """SIGCONT after a pause: the process goes on where it stopped, heartbeats again (if it still exists)."""
        if not (self.alive and self.process == process):
            return  # the launcher killed it meanwhile
        self.hung, self.pause_s = False, None
        self._heartbeat(process, self._new_heartbeat_chain())
        go_on()

    # ------------------------------------------------------------------------- calls

    def _call(self, data: bytes, handle, on_reply, on_error=None, *, wait_for_server: bool = False) -> None:
        self.run.server.call(self, data, handle, on_reply, on_error or self._failed, wait_for_server=wait_for_server)

    def _failed(self, code: str, message: str) -> None:
        """A call failed for a reason the real worker does not recover from."""
        raise LaunchError(f"worker {self.worker_id}: parameter server call failed: {code}: {message}")

    def _after_failure(self, code: str, message: str, then: Callable[[], None], *, in_flight: int = 0) -> None:
        """A call failed: register again after a lost session or a revoked incarnation and go on with ``then``
        (settling the push ``in_flight``, its request id), as the real worker; a revoked worker whose
        rejoin budget is spent exits 1; any other failure is the run's error."""
        try:
            failure = failed_call(code, message, self.worker_id, self.rejoins)
        except IncarnationRevoked:
            self.end("exited with status 1")  # the launcher restarts it
            return
        if failure is None:
            self._failed(code, message)
            return
        step = self.step
        self.last_failure = failure
        if failure == "revoked":
            step.begin_incarnation(self._stats())

        def registered(registration: pb.RegisterReply) -> None:
            applied = bool(in_flight) and registration.last_request_applied
            step.rejoined(failure, in_flight=bool(in_flight), applied=applied)
            then()

        self._register(in_flight, step.carried_to_register(failure), registered)

    def _register(
        self, last_request_id: int, carried: list[pb.Batch], then: Callable[[pb.RegisterReply], None]
    ) -> None:
        request = pb.RegisterRequest(
            worker_id=self.worker_id,
            last_request_id=last_request_id,
            carried_batch_ids=[b.batch_id for b in carried],
            pid=self.pid,
        )

        def registered(data: bytes) -> None:
            registration = pb.RegisterReply.FromString(data)
            self.caller = pb.Caller(worker_id=self.worker_id, session=registration.session)
            self.incarnation = registration.incarnation
            then(registration)

        self._call(request.SerializeToString(), self.run.server.serve_register, registered, wait_for_server=True)

    def _first_registration(self, registration: pb.RegisterReply) -> None:
        run, config = self.run, self.config
        check_layout(self.worker_id, config, run.compute_model, registration, run.placement)
        self.log = MetricsLogger(
            Path(config.system.log_dir) / f"worker_{self.worker_id}",
            tensorboard=run.tensorboard and "tensorboard" in config.metrics.trackers,
            role="worker",
            worker=self.worker_id,
            clock=run.clock.time,
        )
        seed = random.Random(derive_seed(config.training.seed, self.worker_id, self.process))  # its request ids
        self.step = WorkerStep(
            config,
            self.worker_id,
            model=run.compute_model,
            train_set=run.train_set,
            device=torch.device("cpu"),
            log=self.log,
            replica=self.replica,
            faults=self.faults,
            fire_fault=self._fault,
            request_ids=seed.getrandbits(62) or 1,
            placement=run.placement,
        )
        self._heartbeat(self.process, self._new_heartbeat_chain())
        self._pull(first=True)

    def _new_heartbeat_chain(self) -> int:
        self.beating += 1
        return self.beating

    def _heartbeat(self, process: int, chain: int) -> None:
        """Every ``heartbeat_interval`` from the first registration on, while the process runs (not when stopped)."""
        if not self.reachable(process) or chain != self.beating:
            return
        if self.step is not None:
            request = pb.HeartbeatRequest(caller=self.caller, stats=self._stats())
            self._call(
                request.SerializeToString(),
                self.run.server.serve_heartbeat,
                lambda data: None,
                lambda code, message: None,
            )  # a failed heartbeat is ignored, as the real worker's
        self.run.loop.after(self.config.system.heartbeat_interval, lambda: self._heartbeat(process, chain))

    def _stats(self) -> pb.WorkerStats:
        return self.step.stats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            total_time_s=self._now() - self.started_at,
            emulated_delay_s=self.compute_extra_s + self.uplink_delay_s,
        )

    # ------------------------------------------------------------------------- training

    def _pull(self, *, first: bool = False) -> None:
        def pulled(data: bytes) -> None:
            received = split(data, pb.PullReply, MODEL_STATE)
            self.arriving = set()  # every tensor loaded: the next forward waits for none
            if self.run.placement is None:
                self.step.load(received)
                self._pulled(received, first)
                return
            self.step.load(received, parameters=False)  # a sharded run's shard 0: its slices, then the others'
            self.step.load_shard(0, received)
            then = lambda: self._pulled(received, first)  # noqa: E731
            self._pull_shards(received.message.certificate, received.message.version, then, Traffic(), first_shard=1)

        request = pb.PullRequest(caller=self.caller)
        self._call(
            request.SerializeToString(),
            self.run.server.serve_pull,
            pulled,
            lambda code, message: self._after_failure(code, message, lambda: self._pull(first=first)),
        )

    def _pulled(self, received, first: bool) -> None:
        if first:
            self.log.event("run_start", address="virtual", incarnation=self.incarnation, version=self.step.version)
        else:
            self.log.event("rejoined", incarnation=self.incarnation, version=self.step.version, after=self.last_failure)
        self._work(received)

    def _pull_shards(
        self, certificate: bytes, version: int, then: Callable[[], None], traffic: Traffic, *, first_shard: int = 0
    ) -> None:
        """Every shard's slices from ``first_shard`` on, pulled at once (the followers' after applying
        ``certificate``'s version), each loaded as it arrives; ``then`` once all are in, all at shard 0's
        ``version`` (``src.worker``'s ``Worker._pull_shards``)."""
        shards = self.run.shards
        pending = set(range(first_shard, len(shards)))
        versions: dict[int, int] = {}
        for k in range(first_shard, len(shards)):
            request = pb.PullRequest(caller=self.caller, certificate=certificate if k else b"", parameters_only=True)
            data = request.SerializeToString()
            traffic.sent += len(data)

            def pulled(reply: bytes, k: int = k) -> None:
                received = split(reply, pb.PullReply, MODEL_STATE)
                traffic.received += len(reply) + self._load_provisional(received, k)  # and the hold's slices
                versions[k] = self.step.load_shard(k, received)
                pending.discard(k)
                if pending:
                    return
                if self.step.shards_apart(version):  # no shard restarts here: a bug, not a recovery
                    raise LaunchError(
                        f"worker {self.worker_id}: shard 0 at version {version}, the others at "
                        f"{[versions[k] for k in sorted(versions)]}"
                    )
                then()

            shards[k].call(self, data, shards[k].serve_pull, pulled, self._shard_failed(k))

    def _shard_failed(self, shard: int) -> Callable[[str, str], None]:
        """A shard refused a hold or a pull: the run's error. (A real worker registers again, as after a server
        restart, since the launcher restarts every shard from a common version; no shard is killed in virtual time,
        so here a refusal would be the same refusal again.)"""

        def failed(code: str, message: str) -> None:
            raise LaunchError(f"worker {self.worker_id}: server shard {shard} call failed: {code}: {message}")

        return failed

    def _work(self, received) -> None:
        """A reply arrived: finish, or compute the handed batches (their compute seconds from now)."""
        if received.message.work.finished:
            if self.tail_pending:  # the last reply's tensors are still arriving: finish once they are in
                self.after_tail = self._finish
            else:
                self._finish()
            return
        if self.config.system.streaming:
            self._step_streamed(received)
            return
        batches = list(received.message.work.batches)
        step_s, extra_s = (
            self.run.cost.step_s(self.worker_id, sum(len(b.indices) for b in batches)) if batches else (0.0, 0.0)
        )
        process = self.process
        self.step_started = self._now()
        self.run.loop.after(step_s, lambda: self._computed(process, batches, step_s, extra_s))

    def _computed(self, process: int, batches: list[pb.Batch], step_s: float, extra_s: float) -> None:
        """The step's compute time has passed: its real gradient and payloads, then the push after ``compress_s``."""
        if not self.reachable(process):
            return
        step = self.step
        computing = time.perf_counter()
        loss, correct, samples = step.compute(batches)
        self.run.compute_wall_s += time.perf_counter() - computing
        self.compute_extra_s += extra_s
        self.run.timelines.worker(
            self.worker_id, "forward_backward", self._now() - step_s, step=step.totals["steps"] + 1
        )
        step.reach_step()
        if not (self.alive and self.process == process) or (self.hung and self.pause_s is None):
            return  # the fault killed or stopped this process before it sent anything
        # Encoded now, while the shared compute model holds this worker's gradient (a real paused process
        # encodes once it runs again: the same payloads, since nothing they are made of changes meanwhile).
        prepare = self._push if self.run.placement is None else self._push_to_shards
        send = prepare(process, batches, loss, correct, samples, step_s)
        compress_s = self.compress_s
        if self.hung:  # paused: the process goes on (compresses, pushes) once it runs again
            self.run.loop.after(
                self.pause_s, lambda: self._resumed(process, lambda: self.run.loop.after(compress_s, send))
            )
        else:
            self.run.loop.after(compress_s, send)

    def _push(
        self, process: int, batches: list[pb.Batch], loss: float, correct: int, samples: int, step_s: float
    ) -> Callable[[], None]:
        """The push of the step just computed, encoded now; returns what sends it (after ``compress_s``)."""
        step = self.step
        payloads = step.encode(batches)
        payload_bytes = sum(chunk_size(p) for p in payloads)
        # compress_s is what compressing costs: a push sent uncompressed (its Active Fraction, as the controller's
        # rho 1, or a warm-up step's, system.warmup_steps) spends none, as a real worker's does not
        compressed = payload_bytes < step.dense_bytes_per_step
        compress_s = self.compress_s = self.run.cost.compress_s if compressed else 0.0
        request = step.request(
            self.caller, batches, loss, correct, gradient_time_s=step_s, compression_time_s=compress_s
        )
        data = serialize(Outgoing(request, {"gradients": payloads, "buffers": step.buffers_to_send(batches)}))
        del payloads
        step_started = self.step_started

        def send() -> None:
            if not self.reachable(process):
                return
            sent_at = self._now()
            received_before = self.bytes_received
            self.run.timelines.worker(self.worker_id, "compress", sent_at - compress_s)
            settled = self._settler(
                request, batches, (payload_bytes, loss, correct, samples, step_s, compress_s), sent_at, step_started
            )

            def replied(reply_data: bytes) -> None:
                reply = split(reply_data, pb.PushReply, MODEL_STATE + ("parameter_deltas",))
                settled(reply, len(data), self.bytes_received - received_before)

            def failed(code: str, message: str) -> None:
                self._after_failure(code, message, self._pull, in_flight=request.request_id)

            self._call(data, self.run.server.serve_push, replied, failed)

        return send

    def _settler(
        self, request: pb.PushRequest, batches: list[pb.Batch], figures: tuple, sent_at: float, step_started: float
    ) -> Callable[[Any, int, int], None]:
        """What settles the push ``request`` once its reply is in (``figures``: payload bytes, loss, correct,
        samples, compute seconds): ``settled(reply, push_bytes, reply_bytes)`` settles the step, draws its spans
        and takes the reply's work."""
        payload_bytes, loss, correct, samples, step_s, compress_s = figures
        step = self.step

        def settled(reply: Any, push_bytes: int, reply_bytes: int) -> None:
            step.settle(
                reply,
                batches,
                request,
                payload_bytes=payload_bytes,
                loss=loss,
                correct=correct,
                samples=samples,
                gradient_time_s=step_s,
                compression_time_s=compress_s,
                communication_time_s=self._now() - sent_at,
                push_bytes=push_bytes,
                reply_bytes=reply_bytes,
                bytes_sent=self.bytes_sent,
                bytes_received=self.bytes_received,
            )
            timelines = self.run.timelines
            timelines.worker(self.worker_id, "push", sent_at, request_id=request.request_id)
            timelines.worker(self.worker_id, "step", step_started, step=step.totals["steps"])
            self._work(reply)

        return settled

    def _push_to_shards(
        self, process: int, batches: list[pb.Batch], loss: float, correct: int, samples: int, step_s: float
    ) -> Callable[[], None]:
        """A sharded run's push of the step just computed, encoded now (each shard's slices); returns what sends it:
        held on every shard at once, committed to shard 0 once every shard holds it, then every shard pulled at
        once with the commit reply's certificate (``src.worker``'s ``Worker._push_to_shards``). ``push_bytes`` and
        ``reply_bytes`` are the exact sizes of those messages and their replies."""
        step = self.step
        per_shard = step.encode_shards(batches)
        compress_s = self.compress_s = self.run.cost.compress_s
        request = step.request(
            self.caller, batches, loss, correct, gradient_time_s=step_s, compression_time_s=compress_s
        )
        buffers = step.buffers_to_send(batches)
        holds = [
            serialize(Outgoing(held, {"gradients": payloads, "buffers": buffers if k == 0 else []}))
            for k, (held, payloads) in enumerate(zip(step.holds(request), per_shard))
        ]
        payload_bytes = sum(chunk_size(p) for payloads in per_shard for p in payloads)
        del per_shard, buffers
        step_started = self.step_started
        shards = self.run.shards

        def send() -> None:
            if not self.reachable(process):
                return
            sent_at = self._now()
            traffic = Traffic()
            self.run.timelines.worker(self.worker_id, "compress", sent_at - compress_s)
            settled = self._settler(
                request, batches, (payload_bytes, loss, correct, samples, step_s, compress_s), sent_at, step_started
            )
            acknowledged = self._holding(request, traffic, lambda reply: settled(reply, traffic.sent, traffic.received))
            for k, shard in enumerate(shards):
                traffic.sent += len(holds[k])
                shard.call(self, holds[k], shard.serve_push, partial(acknowledged, k), self._shard_failed(k))

        return send

    def _holding(
        self, request: pb.PushRequest, traffic: Traffic, settle: Callable[[Received], None]
    ) -> Callable[[int, bytes], None]:
        """What takes each shard's acknowledgement of ``request``'s hold, ``acknowledged(shard, its bytes)``: once
        every shard holds it, the commit to shard 0 (async: with the followers' staleness), then every shard pulled
        at once with the commit reply's certificate, then ``settle(the commit's reply)``; ``traffic`` counts every
        message and reply from the acknowledgements on."""
        step, shards, server = self.step, self.run.shards, self.run.server
        acks: dict[int, Received] = {}

        def acknowledged(shard: int, ack: bytes) -> None:
            traffic.received += len(ack)
            acks[shard] = split(ack, pb.PushReply, ())
            if len(acks) == len(shards):
                commit = step.commit(request, [acks[k] for k in range(len(shards))])
                committing = serialize(Outgoing(commit, {"gradients": [], "buffers": []}))
                traffic.sent += len(committing)
                self._call(committing, server.serve_push, committed, failed)

        def committed(reply_data: bytes) -> None:
            traffic.received += len(reply_data)
            reply = split(reply_data, pb.PushReply, REPLY_FIELDS)
            self._pull_shards(reply.message.certificate, reply.message.version, lambda: settle(reply), traffic)

        def failed(code: str, message: str) -> None:
            self._after_failure(code, message, self._pull, in_flight=request.request_id)

        return acknowledged

    # ------------------------------------------------------------------------- a streamed step (system.streaming)

    def _step_streamed(self, received) -> None:
        """The real streamed worker's step (``Worker._train_step_streamed``), from now: the forward layer by layer
        as the reply's tensors arrive, backward handing each gradient's part to the link, the push's message after
        it, the step settled when the reply's head is in (see the module docstring). A sharded run: each gradient's
        slices go to the shards holding them, each shard's on the worker's connection to it, as its hold."""
        run, step, process = self.run, self.step, self.process
        batches = list(received.message.work.batches)
        samples_in = sum(len(b.indices) for b in batches)
        step_s, extra_s = run.cost.step_s(self.worker_id, samples_in) if batches else (0.0, 0.0)
        # The real gradient and parts now (the shared compute model holds this worker's gradient only now), in the
        # order the real worker's hooks hand them over; only when they travel is simulated below.
        computing = time.perf_counter()
        run.gradient_order.begin()
        loss, correct, samples = step.compute(batches)
        handed = run.gradient_order.end()
        # (gradient, shard, its index there, its share of the gradient): one part a gradient, or one a slice
        if run.placement is None:
            units = [(index, 0, index, 1.0) for index in handed]
        else:
            slices, on_shard = step.sharded.slices_of(step.names), run.placement.on_shard
            units = [
                (index, k, position, on_shard(k)[position].numel / step.params[index].numel())
                for index in handed
                for k, position in slices[index]
            ]
        sharded = run.placement is not None
        parts = [
            (k, position, step.encode_slice(k, position, batches) if sharded else step.encode_part(position, batches))
            for _, k, position, _ in units
        ]
        buffers = step.buffers_to_send(batches)
        run.compute_wall_s += time.perf_counter() - computing
        self.compute_extra_s += extra_s
        layers = run.layers
        split = split_step(step_s - extra_s, layers.weights)
        backward_s = [b for _, b in split]
        offsets = ready_offsets(backward_s, layers.layer_of)
        dense = sum(layers.param_bytes) or 1
        compress_s = run.cost.compress_s
        self.pushes += 1
        push = (self.worker_id, process, self.pushes)  # the server's key for this push's parts
        for stage in self.stages:  # provisional slices of an earlier push do not count
            stage.clear()
        streamed = StreamedStep(batches, loss, correct, samples, parts, buffers, started=self._now())
        self.step_started = streamed.started
        targets = run.shards if sharded else [run.server]

        def send_part(k: int, position: int, payload) -> None:
            if not self.reachable(process):
                return
            body = b"".join(part_pieces(position, payload))
            if streamed.first_sent is None:
                streamed.first_sent = self._now()
            self.uplinks[k].put(lambda free: targets[k].send_part(self, push, body, free))

        def forward_done(waited_s: float) -> None:
            if not self.reachable(process):
                return
            backward_started = self._now()
            encoded: list[float] = [0.0] * len(units)
            for k in range(len(targets)):  # each connection's parts are encoded on its push's one thread
                mine = [u for u, (_, shard, _, _) in enumerate(units) if shard == k]
                ready = [backward_started + offsets[units[u][0]] for u in mine]
                seconds = [compress_s * layers.param_bytes[units[u][0]] * units[u][3] / dense for u in mine]
                for u, at in zip(mine, encode_times(ready, seconds)):
                    encoded[u] = at
            for (k, position, payload), at in zip(parts, encoded):
                run.loop.at(at, lambda k=k, position=position, payload=payload: send_part(k, position, payload))
            computed = backward_started + sum(backward_s) + extra_s
            close_at = max([computed, *encoded])
            run.loop.at(computed, lambda: self._computed_streamed(process, push, streamed, waited_s, close_at))

        def waited(start: float, end: float) -> None:  # the real worker's forward pre-hook span
            run.timelines.worker(self.worker_id, "parameter_wait", start, end)

        self.forward = ForwardPass(run.loop, [f for f, _ in split], layers.needs, self.arriving, forward_done, waited)
        self.forward.start()

    def provisional(self, body: bytes, shard: int = 0) -> None:
        """A provisional slice arrived from server shard ``shard`` (``system.pipelined_replies``:
        :mod:`src.virtual.sink`): kept until the reply that names it, as the real client keeps it."""
        self.stages[shard].add(body)

    def _load_provisional(self, reply: Received, shard: int = 0) -> int:
        """Put the slices of every parameter ``reply`` (a push's, or a shard's pull's) leaves out (its
        ``provisional``) in its place; returns the bytes of the slices that shard's connection brought (the step's
        reply bytes count them)."""
        stage = self.stages[shard]
        nbytes = stage.nbytes
        stage.fill(reply)
        return nbytes

    def _computed_streamed(
        self, process: int, push: tuple, streamed: StreamedStep, waited_s: float, close_at: float
    ) -> None:
        """Backward (and an emulated straggler's extra seconds) is over: the push's message, once every part is
        encoded, after the parts on the link; the step settles when the reply's head is in. A sharded run: each
        shard's hold after its parts on its connection, the commit and the pulls once every shard holds it, the
        step settled when the pulls are in."""
        if not self.reachable(process):
            return
        run, step = self.run, self.step
        batches, loss, correct, samples = streamed.batches, streamed.loss, streamed.correct, streamed.samples
        parts, started = streamed.parts, streamed.started
        computed = self._now()
        run.timelines.worker(self.worker_id, "forward_backward", started, step=step.totals["steps"] + 1)
        step.reach_step()
        if not self.reachable(process) or self.hung:
            return  # faults are refused with streaming in virtual time (src.virtual.run): a kill before the push
        gradient_time_s = computed - started - waited_s
        request = step.request(
            self.caller, batches, loss, correct, gradient_time_s=gradient_time_s, compression_time_s=run.cost.compress_s
        )
        part_bytes = sum(part_size(payload) for _, _, payload in parts)
        payload_bytes = sum(chunk_size(payload) for _, _, payload in parts)

        def settle(reply: Received, push_bytes: int, reply_bytes: int) -> None:
            now = self._now()
            step.settle(
                reply,
                batches,
                request,
                payload_bytes=payload_bytes,
                loss=loss,
                correct=correct,
                samples=samples,
                gradient_time_s=gradient_time_s,
                compression_time_s=run.cost.compress_s,
                communication_time_s=now - computed + waited_s,
                push_bytes=part_bytes + push_bytes,
                reply_bytes=reply_bytes,
                bytes_sent=self.bytes_sent,
                bytes_received=self.bytes_received,
            )  # every tensor loaded now: the next forward computes from them, its waits are timed by their arrival
            timelines = run.timelines
            timelines.worker(self.worker_id, "reply_wait", computed, now, request_id=request.request_id)
            timelines.worker(self.worker_id, "push", streamed.first_sent or computed, request_id=request.request_id)
            timelines.worker(self.worker_id, "step", started, step=step.totals["steps"])
            self._work(reply)

        if run.placement is not None:
            run.loop.at(close_at, lambda: self._close_holds(process, push, request, streamed.buffers, settle))
            return
        data = serialize(Outgoing(request, {"buffers": streamed.buffers}))

        def on_pieces(reply_data: bytes) -> list[tuple[int, Callable[[], None]]]:
            head, ends, reply = reply_pieces(reply_data, pb.PushReply, REPLY_FIELDS)
            # system.pipelined_replies: the tensors the reply leaves out came as slices before it
            loaded = {("parameters", index) for index in reply.message.provisional}
            ends = [(end, key) for end, key in ends if key not in loaded]
            arriving = {key for _, key in ends}

            def tensor_in(key) -> None:
                arriving.discard(key)
                if self.forward is not None and self.forward.missing is arriving:
                    self.forward.arrived()

            return [(head, lambda: head_in(reply, len(reply_data), arriving))] + [
                (end, lambda key=key: tensor_in(key)) for end, key in ends
            ]

        def head_in(reply: Received, reply_bytes: int, arriving: set) -> None:
            staged_bytes = self._load_provisional(reply)
            self.arriving, self.tail_pending = arriving, True
            settle(reply, len(data), reply_bytes + staged_bytes)

        def whole(_reply_data: bytes) -> None:
            self.tail_pending = False
            after, self.after_tail = self.after_tail, None
            if after is not None:
                after()

        def failed(code: str, message: str) -> None:
            self._after_failure(code, message, self._pull, in_flight=request.request_id)

        def close() -> None:
            if not self.reachable(process):
                return
            server = run.server
            self.uplinks[0].put(
                lambda free: server.call(
                    self, data, server.serve_streamed_push(push), whole, failed, pieces=on_pieces, sent=free
                )
            )

        run.loop.at(close_at, close)

    def _close_holds(
        self,
        process: int,
        push: tuple,
        request: pb.PushRequest,
        buffers: list,
        settle: Callable[[Received, int, int], None],
    ) -> None:
        """A sharded run's streamed push, once every part is encoded: each shard's hold after its parts on the
        worker's connection to it, then the commit and the pulls (:meth:`_holding`); ``settle(the commit's reply,
        bytes sent, bytes received)`` once every slice is in (``Worker._train_step_streamed``)."""
        if not self.reachable(process):
            return
        traffic = Traffic()

        def pulled(reply: Received) -> None:
            self.arriving, self.tail_pending = set(), False  # the pulls brought every slice
            settle(reply, traffic.sent, traffic.received)

        acknowledged = self._holding(request, traffic, pulled)
        for k, (shard, held) in enumerate(zip(self.run.shards, self.step.holds(request))):
            data = serialize(Outgoing(held, {"buffers": buffers if k == 0 else []}))
            traffic.sent += len(data)
            handle, on_ack, failed = shard.serve_streamed_push(push), partial(acknowledged, k), self._shard_failed(k)
            self.uplinks[k].put(
                lambda free, shard=shard, data=data, handle=handle, on_ack=on_ack, failed=failed: shard.call(
                    self, data, handle, on_ack, failed, sent=free
                )
            )

    def _finish(self) -> None:
        stats = self._stats()
        self.finishing = True

        def finished(data: bytes) -> None:
            self.finishing = False
            result = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
            self.step.write_ledger(self.config.system.log_dir)
            self.log.event("run_end", incarnation=self.incarnation, **result)
            self.end(None)

        request = pb.FinishRequest(caller=self.caller, stats=stats)

        def failed(code: str, message: str) -> None:
            self.finishing = False
            self._after_failure(code, message, self._pull)

        self._call(request.SerializeToString(), self.run.server.serve_finish, finished, failed)
