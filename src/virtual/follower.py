"""A follower shard of a virtual-time run with several server shards: the real follower core driven by simulated
messages.

With ``system.num_servers`` = S > 1, shard 0 is the simulated parameter server
(:class:`~src.virtual.server.VirtualServer` with the run's :class:`~src.ps.shards.shard_zero.Sharding`); shards 1..S-1
are :class:`VirtualFollower` objects, each a driver of :class:`~src.ps.shards.follower.FollowerCore`, as
:class:`src.ps.shards.follower_server.FollowerServer` is over real connections. It takes the two calls a real follower
takes, with the protocol's bytes (:mod:`src.ps.shards.rounds`):

* a held push (``PushRequest.hold``): checked, decoded and held by the core, then acknowledged;
* a parameters-only pull (``PullRequest.parameters_only``, with shard 0's certificate of the newest version): the
  core applies that version from exactly the certified pushes, then replies with its slices.

What it adds is *when* (:mod:`src.emulation.cost_model`): each message crosses the worker's link and this shard's
own NIC (its own ``emulation.server_mbps`` each way, :class:`~src.virtual.network.ShardLinks`) in its serialized
size; a held push takes this shard's share of ``server_update_s`` and a pull's reply its share of
``server_reply_s`` (its share of the model's bytes) on its own CPU (:class:`~src.emulation.event_loop.SerialServer`).

At the end of the run (:meth:`VirtualFollower.stop`) it writes its part of the model as a real follower does
(``shard_K_final.pt``, :meth:`~src.ps.shards.follower.FollowerCore.part_checkpoint`); shard 0 reads the parts as the
real one does, by parameters-only pulls with the last certificate (:meth:`VirtualFollower.part_reader`, taking
no virtual time, as evaluations and checkpoints take none). A follower is not killed in virtual time: a run with
injected faults and S > 1 is refused (a shard's recovery is not built in virtual time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Hashable

from src import parameter_server_pb2 as pb
from src.common.checkpoint import save_checkpoint
from src.config import Config
from src.emulation.cost_model import CostModel, ServerTimes
from src.emulation.event_loop import EventLoop, SerialServer
from src.ps.shards.final import shard_part_path
from src.ps.shards.follower import FollowerCore
from src.ps.shards.shard_zero import Sharding
from src.ps.state.streamed_parts import PushParts, arrived_push, push_size
from src.trainer import model_from_config
from src.transport.errors import Refused
from src.transport.grpc_service import PUSH_LARGE_FIELDS
from src.transport.wire import Received, split
from src.virtual.network import ServerLinks
from src.virtual.server import Call, ServerWire
from src.virtual.sink import VirtualSink
from src.virtual.timelines import VirtualTimelines
from src.virtual.worker import VirtualWorker


class VirtualFollower:
    """Simulated follower shard ``shard`` (see the module docstring).

    Args:
        config: the run's config.
        cost: the cost model (the workers' links).
        loop: the event loop everything is scheduled on.
        timelines: where this shard's spans go (``system.trace``).
        sharding: the run's placement and session key (shard 0's and every shard's).
        shard: this shard's index, ``1 .. S - 1``.
        links: this shard's NIC and the workers' links.
        times: this shard's seconds per held push and per reply (:func:`~src.emulation.cost_model.shard_times`).
    """

    def __init__(
        self,
        config: Config,
        cost: CostModel,
        loop: EventLoop,
        timelines: VirtualTimelines,
        *,
        sharding: Sharding,
        shard: int,
        links: ServerLinks,
        times: ServerTimes,
    ):
        self.config = config
        self.shard = shard
        self.clock = loop.clock
        self.timelines = timelines
        self.times = times
        self.core = FollowerCore(
            config,
            model=model_from_config(config),
            placement=sharding.placement,
            shard=shard,
            key=sharding.key,
            clock=loop.clock,
            pid=shard,  # a simulated process: the same events every run
        )
        self.wire = ServerWire(loop, cost, links, shard)
        self.cpu = SerialServer(loop)
        self.parts: dict[Hashable, PushParts] = {}
        """Streamed holds' parts so far, by the worker's key for the push (``system.streaming``)."""
        self.sinks: dict[int, VirtualSink] = {}
        """``system.pipelined_replies``: each worker's connection's provisional slices, by worker id."""
        self.load = self.wire.load = pb.ShardLoad()
        """What this shard carried (the bytes of the holds and pulls answered and of their replies, and provisional
        slices) and the virtual seconds of its update work: its part of a sharded run's summary
        (:func:`~src.ps.shards.final.shard_loads`; with its pipeline's and rollbacks' counts once it stops)."""
        self.core.log.event("listening", address="virtual", port=0)

    downlink_delay_s = property(lambda self: self.wire.downlink_delay_s, doc="Seconds each worker's replies took.")

    def call(
        self,
        worker: VirtualWorker,
        data: bytes,
        handle: Callable[[Call, bytes], None],
        on_reply: Callable[[bytes], None],
        on_error: Callable[[str, str], None],
        *,
        wait_for_server: bool = False,
        sent: Callable[[], None] | None = None,
    ) -> None:
        """Send ``data`` from ``worker`` over its uplink and this shard's NIC; ``handle`` it on arrival (``sent``:
        when ``data`` has left the worker's link)."""
        call = Call(worker, worker.process, on_reply, on_error)
        self.wire.upload(worker, data, lambda: handle(call, data), sent)

    def send_part(self, worker: VirtualWorker, push: Hashable, body: bytes, sent: Callable[[], None]) -> None:
        """One part of the streamed hold ``push`` (the worker's key for it, ``system.streaming``): over the worker's
        link and this shard's NIC, then into the hold's parts, checked and decoded on arrival as a real follower's
        connection thread does (:class:`~src.ps.state.streamed_parts.PushParts`); ``sent`` when it has left the worker's
        link. With ``system.pipelined_replies`` and the worker's connection attached, in pieces of the TCP server's
        reads, each reported as it arrives (the slices step as they come, as on shard 0:
        :meth:`ServerWire.upload_in_reads <src.virtual.server.ServerWire.upload_in_reads>`)."""
        sink = self.wire.attached(self.sinks, worker, worker.process)
        if sink is None:
            self.wire.upload(worker, body, lambda: self._parts(push).add(body), sent)
            return
        self.wire.upload_in_reads(worker, body, lambda: self._parts(push, sink), sent)

    def _parts(self, push: Hashable, sink: VirtualSink | None = None) -> PushParts:
        if push not in self.parts:
            self.parts[push] = PushParts(
                self.core.model.layout,
                PUSH_LARGE_FIELDS,
                self.core.model.max_message_bytes,
                arriving=self.core.arriving(sink),
            )
        return self.parts[push]

    def serve_streamed_push(self, push: Hashable) -> Callable[[Call, bytes], None]:
        """The handler of streamed hold ``push``'s message: its parts and message assembled
        (:meth:`~src.ps.state.streamed_parts.PushParts.assemble`), held as any hold (:meth:`serve_push`)."""

        def handle(call: Call, data: bytes) -> None:
            if self.core.pipeline is not None:  # its next hold's values are reported on this connection
                self.core.attach(call.worker.worker_id, self.wire.sink(self.sinks, call.worker, call.process))
            parts = self._parts(push)
            del self.parts[push]
            self.serve_push(call, parts.assemble(data))

        return handle

    def serve_push(self, call: Call, data) -> None:
        """A held push: this shard's share of ``server_update_s``, then held and acknowledged. ``data``: its bytes, or
        a streamed hold's parts and message assembled (:class:`~src.ps.state.streamed_parts.AssembledPush`)."""
        self.cpu.submit(self.times.update_s, lambda: self._hold(call, data))

    def _hold(self, call: Call, data: bytes) -> None:
        started = self.clock.now - self.times.update_s
        self.timelines.server("hold", started, shard=self.shard, worker=call.worker.worker_id)
        core = self.core
        try:
            try:
                received = arrived_push(data, PUSH_LARGE_FIELDS)
            except ValueError as exc:
                raise Refused("INVALID_ARGUMENT", f"push: {exc}") from None
            request = received.message
            worker_id = core.member(request.caller)
            acknowledgement = core.hold(worker_id, request, core.decode(worker_id, received))
        except Refused as refused:
            self.wire.fail(call, refused.code, refused.message)
            return
        self._answer(call, data, acknowledgement, self._sink_of(call))  # after the slices already on its connection
        self.load.update_s += self.times.update_s

    def serve_pull(self, call: Call, data: bytes) -> None:
        """A parameters-only pull: this shard's share of ``server_reply_s``, then the certified version applied (if it
        is not yet) and the slices sent."""
        self.cpu.submit(self.times.reply_s, lambda: self._pull(call, data))

    def _pull(self, call: Call, data: bytes) -> None:
        started = self.clock.now - self.times.reply_s
        self.timelines.server("reply", started, shard=self.shard, worker=call.worker.worker_id)
        sink = self._sink_of(call)  # system.pipelined_replies: the hold's slices went there
        try:
            reply = self.pull_now(pb.PullRequest.FromString(data), sink)
        except Refused as refused:
            self.wire.fail(call, refused.code, refused.message)
            return
        self._answer(call, data, reply, sink)

    def _sink_of(self, call: Call) -> VirtualSink | None:
        """The provisional slices' line of ``call``'s connection (``None``: no pipelining, or none yet)."""
        return self.wire.attached(self.sinks, call.worker, call.process)

    def _answer(self, call: Call, data, reply: bytes, sink: VirtualSink | None = None) -> None:
        """Send ``reply`` to ``call`` (after ``sink``'s slices, on the same line)."""
        self.load.bytes_in += push_size(data)
        self.load.bytes_out += len(reply)
        if sink is None:
            self.wire.reply(call, reply)
        else:
            sink.then(lambda free: self.wire.reply(call, reply, sent=free))

    def pull_now(self, request: pb.PullRequest, sink: VirtualSink | None = None) -> bytes:
        """The core's answer to a parameters-only pull (no virtual time); ``sink``: the connection it goes on (its
        confirmed provisional slices are left out).

        Raises:
            Refused: the session does not hold, or the certificate is forged or cannot be applied here.
        """
        return self.core.pull(self.core.member(request.caller), request, sink)

    def part_reader(self) -> _PartReader:
        """What :func:`src.ps.shards.final.collect_parts` pulls this shard's part through (as shard 0's client)."""
        return _PartReader(self)

    def stop(self) -> Path:
        """The run is over: write this shard's part of the model (``shard_K_final.pt``); returns where."""
        with self.core.lock:
            part = self.core.part_checkpoint()
            for name in ("slices_sent", "slices_confirmed", "slices_voided", "tensors_omitted", "rolled_back"):
                setattr(self.load, name, getattr(self.core.load, name))
        path = save_checkpoint(shard_part_path(self.config.system.checkpoint_dir, self.shard), part)
        self.core.log.event("run_end", version=self.core.version, part=str(path))
        return path

    def close(self) -> None:
        """Close the event log."""
        self.core.close()


class _PartReader:
    """A parameters-only pull of a follower's part, in process: the client :func:`~src.ps.shards.final.collect_parts`
    expects (``pull(caller, certificate=, parameters_only=, final=)`` returning the split reply)."""

    def __init__(self, follower: VirtualFollower):
        self.follower = follower

    def pull(
        self, caller: pb.Caller, *, certificate: bytes = b"", parameters_only: bool = False, final: bool = False
    ) -> Received:
        request = pb.PullRequest(caller=caller, certificate=certificate, parameters_only=parameters_only, final=final)
        return split(self.follower.pull_now(request), pb.PullReply, ("parameters", "buffers"))
