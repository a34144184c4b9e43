"""The server process of a virtual-time run: the real server core driven by simulated messages.

:class:`VirtualServer` is a driver of :class:`~src.ps.server.core.ServerCore`, as the gRPC service
(:mod:`src.parameter_server`) and the TCP server are: it calls the same core methods in the same
order, under the core's lock, with the real protocol's bytes. What it adds is *when*: a message
crosses the sending worker's link and the server NIC (:class:`~src.emulation.event_loop.SharedLink`, shared
fairly by concurrent transfers) in its serialized size; a push takes ``server_update_s`` and each
reply ``server_reply_s`` of the server's one CPU (:class:`~src.emulation.event_loop.SerialServer`); a Pull or
Push whose work is not there yet (the sync barrier) is parked until it is. An injected server kill
(:class:`ServerKilled`) fails every open call and hands the restart to the launcher
(:class:`~src.virtual.launcher.VirtualLauncher`).

With ``system.num_servers`` = S > 1 it is shard 0 (its core holds a :class:`~src.ps.shards.shard_zero.Sharding`): it
takes held pushes and their commits (:mod:`src.ps.shards.rounds`) and parameters-only pulls, as the real server's
handlers do, with its own NIC in the run's :class:`~src.virtual.network.FairNetwork` and its share of the server's times
(:func:`~src.emulation.cost_model.shard_times`); the followers are :mod:`src.virtual.follower`'s. :class:`ServerWire` is
how any simulated server's messages travel (shared with the followers).

A streamed push (``system.streaming``, :mod:`src.virtual.worker`'s streamed step) reaches it as the real one reaches the
TCP server: each part (:meth:`VirtualServer.send_part`) crosses the worker's link on its own and is taken into the
push's :class:`~src.ps.state.streamed_parts.PushParts` on arrival (checked and decoded there, as the real server does),
then the push's message, which :meth:`VirtualServer.serve_push` handles with the parts assembled, as today's push, when
its last byte is in. Its reply goes down the link in pieces (:attr:`Call.pieces`): the worker hears of the head and of
each tensor as the bytes that complete it arrive.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Hashable

from src import parameter_server_pb2 as pb
from src.common.faults import FaultSpec
from src.config import Config
from src.coordinator import Member
from src.emulation.cost_model import CostModel, ServerTimes
from src.emulation.event_loop import EventLoop, SerialServer
from src.parameter_server import MONITOR_PERIOD_S, planned_work
from src.ps.server.core import PushRefused, Refused, ServerCore
from src.ps.shards.shard_zero import Sharding
from src.ps.state.aggregation import RequestLog
from src.ps.state.streamed_parts import PushParts, arrived_push, push_size
from src.trainer import model_from_config
from src.transport.grpc_service import PUSH_LARGE_FIELDS
from src.transport.tcp_frames import RECEIVE_CHUNK_BYTES
from src.transport.wire import Received
from src.virtual.launcher import VirtualLauncher
from src.virtual.network import OneServerLinks, ServerLinks
from src.virtual.sink import VirtualSink
from src.virtual.timelines import VirtualTimelines
from src.virtual.worker import VirtualWorker


class ServerKilled(BaseException):
    """The simulated server process was killed by an injected fault: whatever it was doing stops."""


@dataclass(eq=False)
class Call:
    """One call of a worker process that the server has not answered yet."""

    worker: VirtualWorker
    process: int
    on_reply: Callable[[bytes], None]
    on_error: Callable[[str, str], None]
    bytes_in: int | None = None  # a Pull or Push: its size, counted into the server's load with its reply
    pieces: Callable[[bytes], list[tuple[int, Callable[[], None]]]] | None = None
    """A streamed push's reply: given the reply's bytes, ``(byte count, callback)`` in byte order: the reply goes
    down in those pieces, each callback called once that many bytes are in (then ``on_reply`` with the whole)."""


@dataclass(eq=False)
class Waiter:
    """A Pull or Push parked at the server until its worker's work is there (the sync barrier, or none left)."""

    call: Call
    member: Member
    push: tuple[int, pb.PushReply] | None = None  # (request id, verdict) for a push
    parked_at: float = 0.0  # virtual seconds


class ServerWire:
    """How a simulated server's messages travel: a worker's message crosses its uplink and the server's NIC in its
    serialized size, then the uplink's latency; a reply the NIC and the worker's downlink, then its latency; an error
    status (a small message) its latency only. Counts each worker's bytes and link delays as the real client does.

    Args:
        loop: the event loop.
        cost: the workers' link figures.
        links: the server's NIC and the workers' links (:mod:`src.virtual.network`).
    """

    def __init__(self, loop: EventLoop, cost: CostModel, links: ServerLinks, shard: int = 0):
        self.loop = loop
        self.clock = loop.clock
        self.cost = cost
        self.links = links
        self.shard = shard
        self.downlink_delay_s: Counter[int] = Counter()
        self.load: pb.ShardLoad | None = None
        """Where the provisional slices sent are counted (the server's load: its bytes out)."""

    def upload(
        self, worker: VirtualWorker, data: bytes, arrived: Callable[[], None], sent: Callable[[], None] | None = None
    ) -> None:
        """Send ``data`` from ``worker`` to the server; ``arrived`` when it is there (``sent``: when its last bit has
        left the link, before the latency: the link is free for the next message)."""
        costs = self.cost.workers[worker.worker_id]
        sent_at = self.clock.now
        worker.bytes_sent += len(data)

        def through() -> None:
            worker.uplink_delay_s += self.clock.now - sent_at
            arrived()

        def out() -> None:
            if sent is not None:
                sent()
            self.loop.after(costs.uplink_latency_s, through)

        self.links.upload(worker.worker_id, 8 * len(data), self.cost.uplink_bps(worker.worker_id, sent_at), out)

    def upload_in_reads(
        self, worker: VirtualWorker, body: bytes, parts: Callable[[], PushParts | None], sent: Callable[[], None]
    ) -> None:
        """Send a streamed push's part ``body`` from ``worker`` in pieces of the TCP server's reads
        (:data:`~src.transport.tcp_frames.RECEIVE_CHUNK_BYTES`), one after another on the link, each reported to the
        push's parts as it arrives (``parts()``; ``None``: the server is gone) and the whole part added, as the real
        server reads a frame; ``sent`` when the last piece has left the link (``system.pipelined_replies``: its
        slices step as they come)."""
        cuts = list(range(0, len(body), RECEIVE_CHUNK_BYTES))[1:] + [len(body)]
        into = memoryview(bytearray(len(body)))

        def piece(k: int, start: int) -> None:
            end = cuts[k]

            def piece_in() -> None:
                into[start:end] = body[start:end]
                target = parts()
                if target is not None:
                    target.progress(into, end)
                    if end == len(body):
                        target.add(into)

            self.upload(worker, body[start:end], piece_in, sent if end == len(body) else lambda: piece(k + 1, end))

        piece(0, 0)

    def sink(self, sinks: dict[int, VirtualSink], worker: VirtualWorker, process: int) -> VirtualSink:
        """The provisional slices' line of ``worker``'s connection from ``process`` in ``sinks`` (a new process: a
        new connection, the old one's closed)."""
        sink = sinks.get(worker.worker_id)
        if sink is None or sink.process != process:
            if sink is not None:
                sink.closed = True
            sink = sinks[worker.worker_id] = VirtualSink(partial(self.provisional, worker, process), process)
        return sink

    @staticmethod
    def attached(sinks: dict[int, VirtualSink], worker: VirtualWorker, process: int) -> VirtualSink | None:
        """The provisional slices' line of ``worker``'s connection from ``process`` in ``sinks``, if it has one
        (``None``: no pipelining, none yet, or an earlier process's)."""
        sink = sinks.get(worker.worker_id)
        return sink if sink is not None and sink.process == process else None

    def reply(self, call: Call, data: bytes, sent: Callable[[], None] | None = None) -> None:
        """Send the server's reply back to the call's worker (delivered if its process still runs); a streamed
        push's in its pieces (:attr:`Call.pieces`), one after another on the link. ``sent``: called when its last
        bit has left the link (the connection's next message may start)."""
        worker = call.worker
        costs = self.cost.workers[worker.worker_id]
        sent_at = self.clock.now

        def arrived() -> None:
            self.downlink_delay_s[worker.worker_id] += self.clock.now - sent_at
            if worker.reachable(call.process):
                worker.bytes_received += len(data)
                call.on_reply(data)

        def out(then: Callable[[], None]) -> None:
            if sent is not None:
                sent()
            self.loop.after(costs.downlink_latency_s, then)

        if call.pieces is None:
            self.links.download(worker.worker_id, 8 * len(data), costs.downlink_bps, lambda: out(arrived))
            return
        # A streamed push's reply: its pieces one after another on the link, each heard of after the latency.
        cuts = call.pieces(data)
        pieces = [(end, lambda c=c: self.deliver(call, c)) for end, c in cuts if end < len(data)]
        last = [c for end, c in cuts if end >= len(data)]  # the tensors the last bytes complete, then the reply

        def whole() -> None:
            for callback in last:
                self.deliver(call, callback)
            arrived()

        pieces.append((len(data), whole))

        def send(k: int, done: int) -> None:
            end, delivered = pieces[k]

            def piece_out() -> None:
                if k + 1 < len(pieces):
                    self.loop.after(costs.downlink_latency_s, delivered)
                    send(k + 1, end)
                else:
                    out(delivered)

            self.links.download(worker.worker_id, 8 * (end - done), costs.downlink_bps, piece_out)

        send(0, 0)

    def provisional(self, worker: VirtualWorker, process: int, body: bytes, sent: Callable[[], None]) -> None:
        """A provisional slice (``system.pipelined_replies``: :mod:`src.virtual.sink`) down to ``worker``'s process
        ``process``, as a reply crosses the NIC and the worker's downlink; ``sent`` when it has left the link."""
        costs = self.cost.workers[worker.worker_id]
        if self.load is not None:
            self.load.bytes_out += len(body)

        def arrived() -> None:
            if worker.reachable(process):
                worker.bytes_received += len(body)
                worker.provisional(body, self.shard)

        def out() -> None:
            sent()
            self.loop.after(costs.downlink_latency_s, arrived)

        self.links.download(worker.worker_id, 8 * len(body), costs.downlink_bps, out)

    def fail(self, call: Call, code: str, message: str) -> None:
        """The call ends with an error status (a small message: its latency only)."""
        costs = self.cost.workers[call.worker.worker_id]
        self.loop.after(costs.downlink_latency_s, lambda: self.deliver(call, lambda: call.on_error(code, message)))

    @staticmethod
    def deliver(call: Call, callback: Callable[[], None]) -> None:
        if call.worker.reachable(call.process):
            callback()


class VirtualServer:
    """The simulated server process: the core (one per process), its NIC, its CPU and its open calls.

    Args:
        config: the run's config.
        cost: the cost model (link, NIC and server figures).
        loop: the event loop everything is scheduled on.
        timelines: where the server's spans go (``system.trace``).
        launcher: the simulated launcher: told of the core's events and of the process's death.
        num_train_samples: the training set's size (the work plan).
        test_set: the split the core evaluates on (a sharded run's shard 0 does not: the run evaluates the whole
            model at its end).
        tensorboard: TensorBoard scalars beside the server's events.
        sharding: serve shard 0 of a sharded run (default: the whole model).
        links: its NIC and the workers' links (default: one server's, :class:`~src.virtual.network.OneServerLinks`).
        times: its seconds per push and per reply (default: the cost model's ``server_update_s``,
            ``server_reply_s``; shard 0's share of them when sharded).
    """

    def __init__(
        self,
        config: Config,
        cost: CostModel,
        loop: EventLoop,
        timelines: VirtualTimelines,
        launcher: VirtualLauncher,
        *,
        num_train_samples: int,
        test_set,
        tensorboard: bool,
        sharding: Sharding | None = None,
        links: ServerLinks | None = None,
        times: ServerTimes | None = None,
    ):
        self.config = config
        self.cost = cost
        self.loop = loop
        self.clock = loop.clock
        self.timelines = timelines
        self.launcher = launcher
        self.num_train_samples = num_train_samples
        self.test_set = test_set
        self.tensorboard = tensorboard
        self.sharding = sharding
        self.times = times or ServerTimes(cost.server_update_s, cost.server_reply_s)
        self.wire = ServerWire(loop, cost, links or OneServerLinks(loop, cost.server_bps))
        self.cpu = SerialServer(loop)
        self.load = self.wire.load = pb.ShardLoad()
        """The bytes of the Pull and Push messages answered and of their replies (and provisional slices), and the
        virtual seconds of update work (a sharded run's summary reports every shard's:
        :func:`~src.ps.shards.final.shard_loads`)."""
        self.core: ServerCore | None = None
        self.running = False
        self.epoch = 0  # one per server process: a call sent to an earlier one fails
        # By arrival, not a set: when the server dies its calls fail in an order that does not depend on memory
        # addresses (Call hashes by identity), so a run is the same whatever else the process allocated.
        self.open_calls: dict[Call, None] = {}
        self.waiting: dict[int, Waiter] = {}
        self.held_for_server: list[Callable[[], None]] = []  # registrations waiting for a server to come up
        self.parts: dict[Hashable, PushParts] = {}  # streamed pushes whose parts are arriving, by the worker's key
        self.sinks: dict[int, VirtualSink] = {}  # system.pipelined_replies: each worker's connection, by worker id

    @property
    def downlink_delay_s(self) -> Counter[int]:
        """Seconds each worker's replies from this server spent on their way."""
        return self.wire.downlink_delay_s

    # ------------------------------------------------------------------------- the process

    def start(self, *, resume: str | Path | None, faults: bool) -> None:
        """A new server process: a core resumed from ``resume`` (if any), then the registrations held for it."""
        self.core = ServerCore(
            self.config,
            work=planned_work(self.config, self.num_train_samples),
            model=model_from_config(self.config),
            test_set=self.test_set if self.sharding is None else None,
            tensorboard=self.tensorboard,
            resume=resume,
            faults=faults,
            fire_fault=self._fault,
            clock=self.clock,
            sharding=self.sharding,
        )
        self.core.serving = True
        self.running = True
        self.epoch += 1
        self.core.log.event("listening", address="virtual", port=0)
        self._monitor(self.epoch)
        held, self.held_for_server = self.held_for_server, []
        for deliver in held:
            deliver()

    def _monitor(self, epoch: int) -> None:
        """Failure detection every :data:`MONITOR_PERIOD_S`, as the real server's monitor thread."""
        if epoch != self.epoch or not self.running or self.core.done.is_set():
            return
        self._serve(lambda: self.launcher.publish(self.core.expire()))
        self.loop.after(MONITOR_PERIOD_S, lambda: self._monitor(epoch))

    def _fault(self, fault: FaultSpec) -> None:
        raise ServerKilled(str(fault))

    def _died(self, reason: str) -> None:
        """The server process is gone: its open calls fail; the launcher restarts it from its newest checkpoint."""
        self.core.log.close()
        self.running = False
        self.cpu.reset()
        self.waiting.clear()
        self.parts.clear()
        for sink in self.sinks.values():
            sink.closed = True
        self.sinks.clear()
        for call in list(self.open_calls):
            self._fail(call, "UNAVAILABLE", "the parameter server went away")
        self.launcher.server_died(reason, lambda checkpoint: self.start(resume=checkpoint, faults=False))

    def _serve(self, action: Callable[[], None]) -> None:
        """Run one server action (lock held), then let waiting calls whose work is now there go on."""
        try:
            with self.core.lock:
                action()
                self._wake()
        except ServerKilled as killed:
            self._died(f"killed by SIGKILL ({killed})")

    # ------------------------------------------------------------------------- messages

    def call(
        self,
        worker: VirtualWorker,
        data: bytes,
        handle: Callable[[Call, bytes], None],
        on_reply: Callable[[bytes], None],
        on_error: Callable[[str, str], None],
        *,
        wait_for_server: bool = False,
        pieces: Callable[[bytes], list[tuple[int, Callable[[], None]]]] | None = None,
        sent: Callable[[], None] | None = None,
    ) -> None:
        """Send ``data`` from ``worker`` over its uplink and the server NIC; the server ``handle``\\ s it on arrival.

        ``wait_for_server``: a server that is down takes the call when it is up again (gRPC's
        ``wait_for_ready``, which registration uses); otherwise the call fails UNAVAILABLE. ``pieces``: the reply
        goes down in pieces (:attr:`Call.pieces`); ``sent``: called when ``data`` has left the worker's link.
        """
        call = Call(worker, worker.process, on_reply, on_error, pieces=pieces)
        epoch = self.epoch

        def arrived() -> None:
            if self.running and (epoch == self.epoch or wait_for_server):
                self.open_calls[call] = None
                self._serve(lambda: handle(call, data))
            elif wait_for_server:
                self.held_for_server.append(
                    lambda: (self.open_calls.setdefault(call), self._serve(lambda: handle(call, data)))
                )
            else:
                self.wire.deliver(call, lambda: call.on_error("UNAVAILABLE", "the parameter server is not reachable"))

        self.wire.upload(worker, data, arrived, sent)

    def send_part(self, worker: VirtualWorker, push: Hashable, body: bytes, sent: Callable[[], None]) -> None:
        """One part of the streamed push ``push`` (the worker's key for it): over the worker's link, then into the
        push's parts (:class:`~src.ps.state.streamed_parts.PushParts`: checked and decoded on arrival, as the real
        server's connection thread does), if this server process still runs; ``sent`` when it has left the worker's
        link.

        With ``system.pipelined_replies`` and the worker's connection attached to the pipeline, the part crosses the
        link in pieces of the TCP server's reads (:data:`~src.transport.tcp_frames.RECEIVE_CHUNK_BYTES`), each reported
        as it arrives (:meth:`~src.ps.state.streamed_parts.PushParts.progress`), as the real server reads a frame."""
        epoch = self.epoch
        sink = self.wire.attached(self.sinks, worker, worker.process)

        def parts() -> PushParts | None:  # None: this server process is gone
            return self._parts(push, sink) if self.running and epoch == self.epoch else None

        if sink is None:

            def arrived() -> None:
                target = parts()
                if target is not None:
                    target.add(body)

            self.wire.upload(worker, body, arrived, sent)
            return
        self.wire.upload_in_reads(worker, body, parts, sent)

    def _parts(self, push: Hashable, sink: VirtualSink | None = None) -> PushParts:
        if push not in self.parts:
            pipeline = self.core.pipeline
            arriving = partial(pipeline.arrived, sink) if pipeline is not None and sink is not None else None
            self.parts[push] = PushParts(
                self.core.model.layout, PUSH_LARGE_FIELDS, self.core.max_message_bytes, arriving=arriving
            )
        return self.parts[push]

    def serve_streamed_push(self, push: Hashable) -> Callable[[Call, bytes], None]:
        """The handler of streamed push ``push``'s message: its parts and message assembled
        (:meth:`~src.ps.state.streamed_parts.PushParts.assemble`), handled as any push (:meth:`serve_push`). With
        ``system.pipelined_replies`` the worker's connection is attached to the pipeline here, as the real server
        attaches it when a push comes on it: its next push's values are reported (:meth:`send_part`)."""

        def handle(call: Call, data: bytes) -> None:
            pipeline = self.core.pipeline
            if pipeline is not None:
                pipeline.attach(call.worker.worker_id, self.wire.sink(self.sinks, call.worker, call.process))
            self.serve_push(call, self._parts(push).assemble(data))
            del self.parts[push]

        return handle

    def _reply(self, call: Call, data: bytes, sink: VirtualSink | None = None) -> None:
        """Send the server's reply back over the server NIC and the worker's downlink (after ``sink``'s slices)."""
        self.open_calls.pop(call, None)
        if call.bytes_in is not None:
            self.load.bytes_in += call.bytes_in
            self.load.bytes_out += len(data)
        if sink is None:
            self.wire.reply(call, data)
        else:
            sink.then(lambda free: self.wire.reply(call, data, sent=free))

    def _fail(self, call: Call, code: str, message: str) -> None:
        """The call ends with an error status."""
        self.open_calls.pop(call, None)
        self.wire.fail(call, code, message)

    # ------------------------------------------------------------------------- the server's side of each call

    def serve_register(self, call: Call, data: bytes) -> None:
        try:
            reply, events = self.core.register(
                pb.RegisterRequest.FromString(data), f"virtual:worker-{call.worker.worker_id}"
            )
        except Refused as refused:
            self._fail(call, refused.code, refused.message)
            return
        self._reply(call, reply.SerializeToString())
        self.launcher.publish(events)

    def serve_pull(self, call: Call, data: bytes) -> None:
        """A Pull parks until its worker's work is there; a sharded run's parameters-only pull (after a commit) takes
        this shard's reply time and gets its slices at once."""
        request = pb.PullRequest.FromString(data)
        call.bytes_in = len(data)
        if request.parameters_only:
            seconds = self.times.reply_s
            self.cpu.submit(seconds, lambda: self._serve(lambda: self._parameters(call, request, seconds)))
            return
        try:
            member = self.core.begin_pull(request.caller)
        except Refused as refused:
            self._fail(call, refused.code, refused.message)
            return
        self.waiting[member.worker_id] = Waiter(call, member, parked_at=self.clock.now)

    def _parameters(self, call: Call, request: pb.PullRequest, seconds: float) -> None:
        self.timelines.server("reply", self.clock.now - seconds, worker=call.worker.worker_id)
        sink = self._sink_of(call)  # system.pipelined_replies: the hold's slices went there, the reply follows them
        try:
            data = self.core.parameters(self.core.member(request.caller), sink)
        except Refused as refused:
            self._fail(call, refused.code, refused.message)
            return
        self._reply(call, data, sink)

    def _sink_of(self, call: Call) -> VirtualSink | None:
        """The provisional slices' line of ``call``'s connection (``None``: no pipelining, or none yet)."""
        return self.wire.attached(self.sinks, call.worker, call.process)

    def serve_push(self, call: Call, data: bytes) -> None:
        """A push takes ``server_update_s`` of the server's time (a sharded run's held push: this shard's share; its
        commit, which carries no tensors: none); its reply follows at once when its work is there. ``data``: its bytes,
        or a streamed push's parts and message assembled (:class:`~src.ps.state.streamed_parts.AssembledPush`)."""
        call.bytes_in = push_size(data)
        try:
            received = arrived_push(data, PUSH_LARGE_FIELDS)
        except ValueError as exc:
            refused = PushRefused("INVALID_ARGUMENT", f"push: {exc}")
            self.cpu.submit(self.times.update_s, lambda: self._serve(lambda: self._malformed(call, refused)))
            return
        request = received.message
        span = "commit" if request.commit else "hold" if request.hold else "apply"
        seconds = 0.0 if request.commit else self.times.update_s
        take = self._hold if request.hold else self._take_push

        def taken() -> None:
            self.load.update_s += seconds
            self.timelines.server(span, self.clock.now - seconds, worker=call.worker.worker_id)
            self._serve(lambda: take(call, received))

        self.cpu.submit(seconds, taken)

    def _malformed(self, call: Call, refused: PushRefused) -> None:
        self.core.refused(None, 0, refused)
        self._fail(call, refused.code, refused.message)

    def _hold(self, call: Call, received: Received) -> None:
        """A sharded run's held push: decoded and held until its commit (:meth:`ServerCore.hold`), acknowledged."""
        core, request = self.core, received.message
        worker_id = request.caller.worker_id
        try:
            acknowledgement = core.hold(core.member(request.caller), request, core.decode(worker_id, received))
        except Refused as refused:
            if isinstance(refused, PushRefused):
                core.refused(worker_id, request.request_id, refused)
            self._fail(call, refused.code, refused.message)
            return
        self._reply(call, acknowledgement, self._sink_of(call))  # after the slices already on its connection

    def _take_push(self, call: Call, received: Received) -> None:
        core = self.core
        request = received.message
        worker_id, request_id = request.caller.worker_id, request.request_id
        try:
            admitted = core.begin_push(request.caller, request)
            if admitted is RequestLog.IN_PROGRESS:
                raise RuntimeError(f"worker {worker_id}: a second copy of push {request_id} while the first is handled")
            if isinstance(admitted, bytes):
                self._reply(call, admitted)  # a retry: answer again, apply nothing
                return
            try:
                verdict = core.apply_push(admitted, request, core.decode(worker_id, received))
            except Refused:
                core.abandon(worker_id, request_id)
                raise
        except Refused as refused:
            if isinstance(refused, PushRefused):
                core.refused(worker_id, request_id, refused)
            self._fail(call, refused.code, refused.message)
            return
        self.waiting[worker_id] = Waiter(call, admitted, (request_id, verdict), parked_at=self.clock.now)
        self._wake(first=worker_id)

    def serve_heartbeat(self, call: Call, data: bytes) -> None:
        request = pb.HeartbeatRequest.FromString(data)
        self._answer(call, lambda: self.core.heartbeat(request.caller, request.stats))

    def serve_finish(self, call: Call, data: bytes) -> None:
        request = pb.FinishRequest.FromString(data)
        self._answer(call, lambda: self.core.finish(request.caller, request.stats))

    def _answer(self, call: Call, respond: Callable[[], Any]) -> None:
        """Reply with the message ``respond`` returns, or fail the call with the core's refusal."""
        try:
            self._reply(call, respond().SerializeToString())
        except Refused as refused:
            self._fail(call, refused.code, refused.message)

    def _wake(self, first: int | None = None) -> None:
        """Every parked call whose work is there now gets its reply built (``server_reply_s`` each, in worker
        order; ``first``'s right away: the real server builds it under the same lock as the push). A sharded run's
        commit reply carries no parameters (the pulls that follow do) and takes none of it."""
        core = self.core
        for worker_id in sorted(self.waiting, key=lambda w: (w != first, w)):
            waiter = self.waiting[worker_id]
            try:
                work = core.poll_work(waiter.member)
            except Refused as refused:
                del self.waiting[worker_id]
                if waiter.push is not None:
                    core.abandon(worker_id, waiter.push[0])
                self._fail(waiter.call, refused.code, refused.message)
                continue
            if work is None:
                continue
            del self.waiting[worker_id]
            self.timelines.server("barrier_wait", waiter.parked_at, calls_of=worker_id, worker=worker_id)
            seconds = 0.0 if self.sharding is not None and waiter.push is not None else self.times.reply_s
            self.cpu.submit(
                seconds,
                lambda w=waiter, work=work, s=seconds: self._serve(lambda: self._build_reply(w, work, s)),
                first=worker_id == first,
            )

    def _build_reply(self, waiter: Waiter, work, seconds: float) -> None:
        self.timelines.server("reply", self.clock.now - seconds, worker=waiter.member.worker_id)
        if waiter.push is None:
            data = self.core.pull_reply(waiter.member, work)
        else:
            request_id, verdict = waiter.push
            sink = self._sink_of(waiter.call)
            data = self.core.push_reply(waiter.member, request_id, verdict, work, sink)
            self._reply(waiter.call, data, sink)
            return
        self._reply(waiter.call, data)
