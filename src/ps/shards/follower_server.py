"""A follower shard of a sharded parameter server: a driver of :class:`~src.ps.shards.follower.FollowerCore` over real
connections.

With ``system.num_servers`` = S > 1, shard 0 is the parameter server (:class:`~src.parameter_server.ParameterServer`
with a :class:`~src.ps.shards.shard_zero.Sharding`): it registers the workers, plans their work and closes each sync
barrier. Shards 1..S-1 run this: each serves its slices of the model (:mod:`src.ps.shards.placement`) on its own
address, over the run's transport (gRPC or TCP, the same handlers and framing as shard 0's), and takes two calls:

* ``Push`` with ``hold``: a worker's slices, decoded outside the lock and held until shard 0 certifies the
  version (:mod:`src.ps.shards.rounds`); the reply is an acknowledgement.
* ``Pull`` with ``parameters_only`` (and shard 0's certificate of the newest version): applies that version
  from exactly the certified pushes, then replies with the slices.

Every other call (Register, Initialize, Heartbeat, Finish) is for shard 0 and is refused with a line that says
so. Sessions are checked here by their signature, with no round trip to shard 0. At :meth:`FollowerServer.stop`
the shard writes its part of the model (``shard_K_final.pt`` beside ``system.checkpoint_dir``'s
``parameter_server_final.pt``) for the launcher to put the whole model together.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from torch import nn

from src import parameter_server_pb2 as pb
from src.common.checkpoint import save_checkpoint
from src.config import Config
from src.ps.shards.final import shard_part_path
from src.ps.shards.follower import FollowerCore
from src.ps.shards.shard_zero import Sharding
from src.ps.state.decoding import arriving_push_splitter
from src.ps.state.streamed_parts import PushParts, arrived_push, push_size
from src.telemetry import tracing
from src.trainer import model_from_config
from src.transport.errors import Refused
from src.transport.grpc import start_grpc_server
from src.transport.grpc_service import PUSH_LARGE_FIELDS, Call, GrpcMethods
from src.transport.settings import require_auth_token
from src.transport.sinks import Sink
from src.transport.wire import MessageSplitter, Pieces


class FollowerServer(GrpcMethods):
    """Follower shard ``shard`` served on ``address`` (see the module docstring).

    Args:
        config: the run's config (the same as shard 0's).
        shard: this shard's index, ``1 .. system.num_servers - 1`` (the placement and the session key are the
            run's: :meth:`Sharding.of_run <src.ps.shards.shard_zero.Sharding.of_run>`).
        address: ``host:port`` to serve on (port 0: a free one).
        token: the auth token every call must carry (default: :func:`require_auth_token`).
        model: the model at its initial values (default ``model_from_config(config)``, as shard 0 builds it).
        transport: ``"grpc"`` or ``"tcp"`` (default ``system.transport``).
        resume: continue from this shard's checkpoint (a file, or the run's checkpoint folder).
        recovering: start again across hosts: wait for shard 0 to choose the version (:mod:`src.ps.shards.recovery`).
    """

    def __init__(
        self,
        config: Config,
        *,
        shard: int,
        address: str,
        token: str | None = None,
        model: nn.Module | None = None,
        transport: str | None = None,
        resume: str | Path | None = None,
        recovering: bool = False,
    ):
        self.config = config
        self.shard = shard
        self.address = address
        self.transport = transport or config.system.transport
        self.token = token or require_auth_token(config.system)
        model = model if model is not None else model_from_config(config)
        sharding = Sharding.of_run(model, config.system, self.token)
        self.placement = sharding.placement
        self.core = FollowerCore(
            config,
            model=model,
            placement=sharding.placement,
            shard=shard,
            key=sharding.key,
            reply_views=True,  # pull replies are sent from the slices' own memory, as shard 0's
            resume=resume,
            recovering=recovering,
        )
        self._stop_serving: Any = None
        self.port: int | None = None
        self.stopped = threading.Event()

    def start(self) -> int:
        """Serve on ``address``; returns the bound port."""
        system = self.config.system.model_copy(update={"server_address": self.address})
        max_calls = 3 * system.num_workers + 8
        max_message_bytes = self.core.model.max_message_bytes
        if self.transport == "tcp":
            from src.transport.tcp_server import TCPServer

            tcp = TCPServer(
                self, system, token=self.token, max_message_bytes=max_message_bytes, max_connections=max_calls
            )
            self.port = tcp.start()
            self._stop_serving = tcp.stop
        else:
            server, self.port = start_grpc_server(
                self, system, token=self.token, max_message_bytes=max_message_bytes, max_threads=max_calls
            )
            self._stop_serving = lambda grace: server.stop(grace).wait()
        self.core.log.event("listening", address=self.address, port=self.port, transport=self.transport)
        return self.port

    def stop(self, grace: float = 2.0) -> Path:
        """Stop serving and write this shard's part of the model; returns where."""
        if self._stop_serving is not None:
            self._stop_serving(grace)
        with self.core.lock:
            checkpoint = self.core.part_checkpoint()
            version = self.core.version
        path = save_checkpoint(shard_part_path(self.config.system.checkpoint_dir, self.shard), checkpoint)
        self.core.log.event("run_end", version=version, part=str(path))
        self.core.close()
        self.stopped.set()
        return path

    # ------------------------------------------------------------------------- calls (every transport)

    def handle_push(self, data, call: Call) -> bytes:
        with tracing.span("serve_hold"):
            try:
                received = arrived_push(data, PUSH_LARGE_FIELDS)
            except ValueError as exc:
                raise Refused("INVALID_ARGUMENT", f"push: {exc}") from None
            request = received.message
            worker_id = self.core.member(request.caller)
            self.core.attach(worker_id, getattr(call, "sink", None))  # its next hold's values are reported there
            reply = self.core.hold(worker_id, request, self.core.decode(worker_id, received))
            with self.core.lock:
                self.core.load.bytes_in += push_size(data)
                self.core.load.bytes_out += len(reply)
            return reply

    def push_splitter(self, data) -> MessageSplitter:
        """A splitter of a push arriving into ``data`` (TCP reads it in pieces): each gradient checked as its bytes
        come in and decoded once whole, as shard 0 does (:func:`~src.ps.state.decoding.arriving_push_splitter`)."""
        return arriving_push_splitter(self.core.model.layout, data, PUSH_LARGE_FIELDS)

    def push_parts(self, max_bytes: int, sink: Sink | None = None) -> PushParts:
        """The parts of a streamed hold about to arrive (:mod:`src.ps.state.streamed_parts`), decoded as they come.
        ``sink``: the connection's, with ``system.pipelined_replies`` (its dense values are reported as they arrive, and
        the slices stepped go to every worker of the round: :mod:`src.ps.state.slice_pipeline`)."""
        return PushParts(self.core.model.layout, PUSH_LARGE_FIELDS, max_bytes, arriving=self.core.arriving(sink))

    @property
    def pipelined(self) -> bool:
        """Whether provisional slices are sent (``system.pipelined_replies``): the TCP transport then gives each
        connection a :class:`~src.ps.state.slice_pipeline.Sink`."""
        return self.core.pipeline is not None

    def sent_provisional(self, nbytes: int) -> None:
        """The transport wrote ``nbytes`` of provisional slices: counted as sent."""
        with self.core.lock:
            self.core.load.bytes_out += nbytes

    def after_reply(self) -> None:
        """Nothing waits for a reply to be out here (the events are written at once)."""

    def handle_pull(self, request: pb.PullRequest, call: Call) -> bytes | Pieces:
        with tracing.span("serve_pull", worker=request.caller.worker_id):
            worker_id = self.core.member(request.caller)
            reply = self.core.pull(worker_id, request, getattr(call, "sink", None))
            with self.core.lock:
                self.core.load.bytes_in += request.ByteSize()
                self.core.load.bytes_out += len(reply)
            return reply

    def _for_shard_0(self, what: str):
        raise Refused(
            "UNIMPLEMENTED",
            f"shard {self.shard} holds pushes and serves pulls only: {what} goes to shard 0 (system.server_address)",
        )

    def handle_register(self, request: pb.RegisterRequest, peer: str) -> pb.RegisterReply:
        self._for_shard_0("Register")

    def handle_initialize(self, data) -> pb.InitializeReply:
        self._for_shard_0("Initialize")

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self._for_shard_0("Heartbeat")

    def handle_finish(self, request: pb.FinishRequest) -> pb.FinishReply:
        self._for_shard_0("Finish")

    def handle_status(self) -> pb.StatusReply:
        with self.core.lock:
            return pb.StatusReply(
                version=self.core.version if self.core.ready else -1,  # -1: starting again, no version yet
                num_workers=self.config.system.num_workers,
                load=self.core.load,
                checkpoints=self.core.checkpoint_versions(),
                instance=self.core.instance,
            )
