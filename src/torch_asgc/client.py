"""connect() and WorkerClient: one worker process's membership in a parameter-server run.

The client registers with the server (a new incarnation with its own session secret), learns the
run's config (mode, compression, heartbeat interval), sends a heartbeat every
``system.heartbeat_interval`` from a background thread, and re-registers when the server has lost
its session (a restarted server; the transport's ``wait_for_ready`` waits out the restart). Every call after
registration carries the session, so a late call from a failed incarnation is refused. A process
whose incarnation the server declared failed while it was alive (a partition, a long pause) rejoins:
it registers again as a new incarnation and goes on (a push whose reply it lost is committed or
rolled back by what the server says, as after a restart), up to ``max_rejoins`` times (default the
server's ``system.max_rejoins``); then the call raises :class:`~src.ps.worker_protocol.IncarnationRevoked`.

It moves no tensors by itself: :class:`~torch_asgc.model.DistributedModel` pulls and initializes
through it, :class:`~torch_asgc.optim.DistributedOptimizer` pushes through it. A server with
``system.streaming`` gets streamed pushes (:meth:`WorkerClient.push_streamed`): each runs on the client's push
thread, one after the other, the next one's parts waiting until the previous reply's tensors are all in. A sharded
server's streamed step (:meth:`WorkerClient.push_shards_streamed`) is one streamed hold per shard, each on that
shard's own push thread, then the commit and the pulls as unstreamed (:meth:`WorkerClient.commit_shards`).
``close()`` (or the end of a ``with`` block) tells the server this worker is done (``Finish``, with its totals for
the run summary); in sync mode the barrier goes on without it.

    with connect("127.0.0.1:50051") as client:      # token: $DTS_AUTH_TOKEN; "tcp://127.0.0.1:50051": TCP transport
                                                      # a sharded server: connect(["h1:p1", "h2:p2"]), shard 0 first
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), client)
        ...                                           # the user's own loop
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Protocol, Sequence

import grpc

from src import parameter_server_pb2 as pb
from src.config import Config, SetupError, SystemConfig, validate_config
from src.ps import shard_step
from src.ps.worker_protocol import Failure, Heartbeats, IncarnationRevoked, Rejoins, check_session_lost
from src.transport.clients import TRANSPORTS, make_client
from src.transport.grpc import AUTH_TOKEN_ENV, Received
from src.transport.stream import PushStream
from src.transport.wire import Outgoing


class ModelUser(Protocol):
    """What the client asks of the model that uses it (:class:`~torch_asgc.model.DistributedModel` is one): to
    offer its layout again, to a server that restarted before its first checkpoint."""

    def offer(self) -> None: ...


logger = logging.getLogger(__name__)


class WorkerClient:
    """One worker's connection to the parameter server; see the module docstring. Use :func:`connect`.

    Attributes:
        worker_id: this worker's id (the server's choice when :func:`connect` got none).
        incarnation: the current registration's incarnation number.
        config: the run's config as the server sent it (``config.system.aggregation_mode``, compression, ...).
        model: the :class:`~torch_asgc.model.DistributedModel` using this client, once there is one.
        totals: this process's running totals (steps, samples, times, bytes), sent with heartbeats.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        token: str | None = None,
        worker_id: int | None = None,
        tls_ca_file: str | None = None,
        connect_timeout_s: float = 300.0,
        max_rejoins: int | None = None,
        transport: str | None = None,
    ):
        token = token or os.environ.get(AUTH_TOKEN_ENV)
        if not token:
            raise SetupError(f"no auth token: pass token=... to connect() or set ${AUTH_TOKEN_ENV}")
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise SetupError("connect(): no address (give the server's host:port, or every shard's, shard 0 first)")
        located = [transport_of(each, transport) for each in addresses]
        if len({kind for _, kind in located}) > 1:
            raise SetupError(f"connect({addresses}): the shards' addresses name different transports")
        self.token = token
        self.address = located[0][0]
        self.transport, *self.shard_transports = [
            make_client(
                each,
                transport=kind,
                token=token,
                system=SystemConfig(tls_ca_file=tls_ca_file),
                connect_timeout_s=connect_timeout_s,
            )
            for each, kind in located
        ]
        self._shard_calls = (
            ThreadPoolExecutor(len(addresses), thread_name_prefix="asgc-shard") if len(addresses) > 1 else None
        )
        self.worker_id = worker_id
        self.incarnation = 0
        self.caller = pb.Caller()
        self.config: Config | None = None
        self.registration: pb.RegisterReply | None = None
        self.model: ModelUser | None = None
        self.totals: dict[str, Any] = dict(
            samples=0,
            steps=0,
            steps_skipped=0,
            pushes_rejected=0,
            gradient_time_s=0.0,
            compression_time_s=0.0,
            communication_time_s=0.0,
            payload_bytes=0,
            dense_bytes=0,
            train_loss=0.0,
        )
        self._request_id = secrets.randbits(62) or 1  # random start: a restarted process's ids do not collide
        self._max_rejoins = max_rejoins
        self.rejoins: Rejoins | None = None  # set at the first registration (the default is the server's)
        self._heartbeats: Heartbeats | None = None
        self._started = time.perf_counter()
        self.closed = False
        self._push_threads: dict[int, ThreadPoolExecutor] = {}  # system.streaming: per shard, moves its streamed pushes
        self._streams: dict[PushStream, Future] = {}  # streamed pushes whose call has not ended
        self._unclosed: set[PushStream] = set()  # ... and of those, the ones still taking parts

    # ------------------------------------------------------------------------- lifecycle

    def open(self) -> "WorkerClient":
        """Register and start heartbeats (:func:`connect` calls it).

        Raises:
            SetupError: the server runs another number of shards than the addresses given.
        """
        self._register(0)
        shards = self.config.system.num_servers
        if shards != 1 + len(self.shard_transports):
            raise SetupError(
                f"the server runs {shards} shard{'s' if shards > 1 else ''}: connect() to every shard's host:port, "
                f"shard 0 first (got {1 + len(self.shard_transports)} address{'es' if self.shard_transports else ''})"
            )
        self.rejoins = Rejoins(
            self.worker_id, self.config.system.max_rejoins if self._max_rejoins is None else self._max_rejoins
        )
        interval = self.config.system.heartbeat_interval
        self._heartbeats = Heartbeats(
            lambda: self.transport.heartbeat(self.caller, self.stats(), timeout=2 * interval),
            interval,
            name=f"asgc-worker-{self.worker_id}-heartbeat",
        )
        self._heartbeats.start()
        return self

    def close(self) -> None:
        """Leave the run: Finish with this worker's totals, stop heartbeats, close the channel (idempotent).

        Raises:
            grpc.RpcError: the server refused Finish (e.g. this incarnation was failed meanwhile).
        """
        if self.closed:
            return
        self.closed = True
        try:
            self._end_streams()
            self._call_with_rejoin(lambda: self.transport.finish(self.caller, self.stats()))
        finally:
            self._close_shards()
            if self._heartbeats is not None:
                self._heartbeats.stop_and_close(self.transport.close)
            else:
                self.transport.close()

    def _close_shards(self) -> None:
        for shard in self.shard_transports:
            shard.close()
        if self._shard_calls is not None:
            self._shard_calls.shutdown()
        for thread in self._push_threads.values():
            thread.shutdown()

    def _end_streams(self) -> None:
        """Before Finish: a streamed push still taking parts (a backward with no step after it) is given up, and
        the last reply's tensors are waited for (so the totals count every byte)."""
        for stream in list(self._unclosed):
            self.abort_push_stream(stream, SetupError("the client closed before the step that would end this push"))
        wait(list(self._streams.values()))

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
            return
        try:  # leaving because of an error: do not hide it behind a failed Finish
            self.close()
        except Exception as exc:  # noqa: BLE001
            logger.warning("worker %s: could not leave the run cleanly (%s)", self.worker_id, exc)

    @property
    def mode(self) -> str:
        """``sync`` or ``async``: the server's aggregation mode."""
        return self.config.system.aggregation_mode

    def stats(self) -> pb.WorkerStats:
        """This process's running totals (read by the heartbeat thread too)."""
        t = self.totals
        return pb.WorkerStats(
            samples=t["samples"],
            steps=t["steps"],
            bytes_sent=sum(t.bytes_sent for t in [self.transport, *self.shard_transports]),
            bytes_received=sum(t.bytes_received for t in [self.transport, *self.shard_transports]),
            gradient_time_s=t["gradient_time_s"],
            compression_time_s=t["compression_time_s"],
            communication_time_s=t["communication_time_s"],
            total_time_s=time.perf_counter() - self._started,
            train_loss=t["train_loss"],
            pushes_rejected=t["pushes_rejected"],
            payload_bytes=t["payload_bytes"],
            dense_bytes=t["dense_bytes"],
        )

    # ------------------------------------------------------------------------- calls (used by the model and optimizer)

    def next_request_id(self) -> int:
        self._request_id += 1
        return self._request_id

    def initialize(self, request: pb.InitializeRequest, parameters: Sequence[Any], buffers: Sequence[Any]) -> bool:
        """Offer the model to a server that has none; whether ours became its version 0."""
        request.caller.CopyFrom(self.caller)
        return self._call_with_rejoin(lambda: self.transport.initialize(request, parameters, buffers)).accepted

    def pull(self) -> Received:
        """The newest parameters (sync: once this worker's turn in the barrier has come)."""
        return self._call_with_rejoin(lambda: self.transport.pull(self.caller))

    def push(self, request: pb.PushRequest, gradients: Sequence[Any], buffers: Sequence[Any]) -> Received | bool:
        """Send one step; the reply, or, when the reply was lost with the server's session, whether the
        server had applied the push (this client has registered again meanwhile).

        Raises:
            IncarnationRevoked: the server declared this incarnation failed, and the rejoin budget is spent.
            grpc.RpcError: the server refused the push (the message names the problem).
        """
        request.caller.CopyFrom(self.caller)
        try:
            return self.transport.push(request, gradients, buffers)
        except grpc.RpcError as exc:
            failure = check_session_lost(exc, self.worker_id, self.rejoins)
        return self._register_after(failure, request.request_id).last_request_applied

    # ---------------------------------------------------------------------- streamed pushes (system.streaming)

    def push_streamed(
        self, stream: PushStream, on_end: Callable[[Future], Any] | None = None, *, shard: int = 0
    ) -> Future:
        """Start a streamed push (:mod:`src.transport.stream`) on the client's push thread (shard ``shard``'s, of a
        sharded server): its parts go as ``stream`` takes them, once the previous streamed push's reply is all in.
        Returns the call (its result: the whole reply); ``on_end(call)`` runs when it ends (on the push thread).
        Finish it with :meth:`close_push_stream` and :meth:`push_stream_head`, or give it up with
        :meth:`abort_push_stream`."""
        thread = self._push_threads.get(shard)
        if thread is None:
            thread = self._push_threads[shard] = ThreadPoolExecutor(
                1, thread_name_prefix=f"asgc-worker-{self.worker_id}-push{f'-shard-{shard}' if shard else ''}"
            )
        self._unclosed.add(stream)
        call = thread.submit([self.transport, *self.shard_transports][shard].push_streamed, stream)
        self._streams[stream] = call

        def ended(done: Future) -> None:
            self._streams.pop(stream, None)
            if on_end is not None:
                on_end(done)

        call.add_done_callback(ended)
        return call

    def close_push_stream(
        self,
        stream: PushStream,
        request: pb.PushRequest,
        buffers: Sequence[Any],
        before_send: Callable[[], None] | None = None,
    ) -> None:
        """Every part of ``stream`` is handed over: its push's small fields (with this registration's session) and
        ``buffers`` follow (``before_send``: :meth:`PushStream.close <src.transport.stream.PushStream.close>`'s)."""
        request.caller.CopyFrom(self.caller)
        self._unclosed.discard(stream)
        stream.close(Outgoing(request, {"buffers": list(buffers)}), before_send=before_send)

    def abort_push_stream(self, stream: PushStream, error: BaseException) -> None:
        """Give up ``stream`` before its push's message (its parts are dropped by the server); returns once its
        call has ended, so nothing more is encoded for it."""
        self._unclosed.discard(stream)
        stream.abort(error)
        call = self._streams.get(stream)
        if call is not None:
            wait([call])

    def push_stream_head(self, stream: PushStream, request_id: int) -> pb.PushReply | bool:
        """The reply head of closed ``stream`` (verdict, version; its tensors go on arriving), or, when the push was
        lost with the server's session, whether the server had applied it (registered again meanwhile), as
        :meth:`push`.

        Raises:
            IncarnationRevoked: the server declared this incarnation failed, and the rejoin budget is spent.
            grpc.RpcError: the server refused the push (the message names the problem).
        """
        try:
            return stream.wait_head()
        except grpc.RpcError as exc:
            failure = check_session_lost(exc, self.worker_id, self.rejoins)
        call = self._streams.get(stream)
        if call is not None:
            wait([call])
        return self._register_after(failure, request_id).last_request_applied

    # ---------------------------------------------------------------------- a sharded server (src/ps/shard_step.py)

    @property
    def sharded(self) -> bool:
        """Whether the server is split across shards (this client holds a connection to each)."""
        return bool(self.shard_transports)

    def pull_shards(self, certificate: bytes = b"", *, first: int = 0) -> list[Received]:
        """Each shard's slices from shard ``first`` on, at once (a follower's after applying ``certificate``'s
        version), in shard order."""
        transports = [self.transport, *self.shard_transports]
        pulls = [
            self._shard_calls.submit(
                transports[k].pull, self.caller, certificate=certificate if k else b"", parameters_only=True
            )
            for k in range(first, len(transports))
        ]
        return [pull.result() for pull in pulls]

    def push_shards(
        self,
        request: pb.PushRequest,
        per_shard: Sequence[Sequence[Any]],
        buffers: Sequence[Any],
        versions: Sequence[int],
    ) -> tuple[Received, list[Received]] | bool:
        """A sharded server's step (:mod:`src.ps.shard_step`): hold each shard's payloads on it at once, each based on
        ``versions[k]``, the version of shard ``k``'s slices the gradient was computed on (``per_shard`` empty: a
        skipped step, held on shard 0 only), then :meth:`commit_shards`.

        Raises:
            IncarnationRevoked: shard 0 declared this incarnation failed, and the rejoin budget is spent.
            grpc.RpcError: a shard refused the push (the message names the problem).
        """
        request.caller.CopyFrom(self.caller)
        transports = [self.transport, *self.shard_transports] if per_shard else [self.transport]
        held = shard_step.holds(request, versions[: len(transports)])
        calls = [
            self._shard_calls.submit(
                transport.push, held[k], per_shard[k] if per_shard else [], buffers if k == 0 else []
            )
            for k, transport in enumerate(transports)
        ]
        acks = [call.result().message for call in calls]
        return self.commit_shards(request, acks, versions[0], self.mode if per_shard else "sync")

    def push_shards_streamed(
        self, streams: Sequence[PushStream], on_end: Callable[[Future], Any] | None = None
    ) -> list[Future]:
        """A sharded server's streamed step (``system.streaming``): ``streams[k]`` is shard ``k``'s hold, its parts
        its slices (:meth:`ShardedPushCodec.encode_slice <src.ps.shard_push.ShardedPushCodec.encode_slice>`), each
        on shard ``k``'s push thread (:meth:`push_streamed`). Close them with :meth:`close_shard_streams`, finish
        with :meth:`shard_streams_commit`, or give each up with :meth:`abort_push_stream`."""
        return [self.push_streamed(stream, on_end, shard=k) for k, stream in enumerate(streams)]

    def close_shard_streams(
        self, streams: Sequence[PushStream], request: pb.PushRequest, buffers: Sequence[Any], versions: Sequence[int]
    ) -> None:
        """Every slice of ``streams`` is handed over: each shard's hold of ``request`` follows
        (:func:`src.ps.shard_step.holds`, based on ``versions[k]``; shard 0's with ``buffers``), carrying the seconds
        its stream spent encoding."""
        request.caller.CopyFrom(self.caller)
        for k, (stream, held) in enumerate(zip(streams, shard_step.holds(request, versions))):

            def compression_time(stream: PushStream = stream, held: pb.PushRequest = held) -> None:
                held.metrics.compression_time_s = stream.encode_s

            self.close_push_stream(stream, held, buffers if k == 0 else [], before_send=compression_time)

    def shard_streams_commit(
        self, streams: Sequence[PushStream], request: pb.PushRequest, versions: Sequence[int]
    ) -> tuple[Received, list[Received]] | bool:
        """The closed ``streams``' step goes on as unstreamed once every shard holds its slices (their replies'
        heads): :meth:`commit_shards` (the commit carries every stream's encoding seconds).

        Raises:
            IncarnationRevoked: shard 0 declared this incarnation failed, and the rejoin budget is spent.
            grpc.RpcError: a shard refused its hold, as :meth:`push_shards` raises it (every stream's call has
                ended), or the commit.
        """
        try:
            acks = [stream.wait_head() for stream in streams]
        except BaseException:
            wait([call for call in (self._streams.get(stream) for stream in streams) if call is not None])
            raise
        request.metrics.compression_time_s = sum(stream.encode_s for stream in streams)
        return self.commit_shards(request, acks, versions[0], self.mode)

    def commit_shards(
        self, request: pb.PushRequest, acks: Sequence[pb.PushReply], base_version: int, mode: str
    ) -> tuple[Received, list[Received]] | bool:
        """The rest of a sharded step once every shard holds its slices (``acks``: the holds' replies, in shard order,
        streamed or not): commit to shard 0 (based on ``base_version``; ``mode`` async: with the followers'
        staleness), then pull every shard at once with the certificate. Returns the commit's reply and the pulls,
        or, when the reply was lost with shard 0's session (this client registered again), whether the push was
        applied.

        Raises:
            IncarnationRevoked: shard 0 declared this incarnation failed, and the rejoin budget is spent.
            grpc.RpcError: shard 0 refused the commit, or a shard the pull.
        """
        reply = self.push(shard_step.commit(request, acks, base_version, mode), [], [])
        if isinstance(reply, bool):
            return reply
        return reply, self.pull_shards(reply.message.certificate)

    # ------------------------------------------------------------------------- registration

    def _register(self, last_request_id: int) -> pb.RegisterReply:
        first = self.registration is None
        reply = self.transport.register(
            self.worker_id or 0, last_request_id, any_worker_id=first and self.worker_id is None
        )
        self.registration = reply
        self.worker_id = reply.worker_id
        self.incarnation = reply.incarnation
        self.caller = pb.Caller(worker_id=reply.worker_id, session=reply.session)
        self.config = validate_config(json.loads(reply.run_config_json))
        if not first and reply.model_wanted and self.model is not None:
            self.model.offer()  # a server restarted before its first checkpoint: it needs the model again
        return reply

    def _register_after(self, failure: Failure, last_request_id: int) -> pb.RegisterReply:
        if failure == "lost":
            logger.warning("worker %s: lost the server's session; registering again", self.worker_id)
        reply = self._register(last_request_id)
        if failure == "revoked":
            logger.info("worker %s: rejoined as incarnation %d", self.worker_id, self.incarnation)
        return reply

    def _call_with_rejoin(self, call):
        """``call()``, registering again while the server has lost this session or revoked this incarnation."""
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                failure = check_session_lost(exc, self.worker_id, self.rejoins)
            self._register_after(failure, 0)


def transport_of(address: str, transport: str | None) -> tuple[str, str]:
    """``(host:port, transport)`` of an address that may name its transport (``tcp://host:port``,
    ``grpc://host:port``); a plain ``host:port`` uses ``transport`` (default gRPC).

    Raises:
        SetupError: an unknown scheme, or a scheme and a ``transport`` that disagree.
    """
    scheme, separator, rest = address.partition("://")
    if not separator:
        return address, transport or "grpc"
    if scheme not in TRANSPORTS:
        raise SetupError(
            f"address {address!r}: unknown transport {scheme!r} (use {' or '.join(f'{t}://' for t in TRANSPORTS)})"
        )
    if transport is not None and transport != scheme:
        raise SetupError(f"address {address!r} names transport {scheme!r}, but transport={transport!r}")
    return rest, scheme


def connect(
    address: str | Sequence[str],
    token: str | None = None,
    worker_id: int | None = None,
    *,
    tls_ca_file: str | None = None,
    connect_timeout_s: float = 300.0,
    max_rejoins: int | None = None,
    transport: str | None = None,
) -> WorkerClient:
    """Join the parameter-server run at ``address`` as one worker; a context manager (``close()`` on exit).

    Args:
        address: the server's ``host:port``, or ``tcp://host:port`` / ``grpc://host:port`` naming the transport; a
            sharded server's: a list of every shard's, shard 0 first (``connect(["h1:p1", "h2:p2"])``).
        token: the run's auth token (default ``$DTS_AUTH_TOKEN``).
        worker_id: ``0..num_workers-1``; ``None`` lets the server pick the lowest free id.
        tls_ca_file: verify a TLS server against this CA (or its self-signed certificate).
        connect_timeout_s: how long to wait for the server to come up (and to come back after a restart).
        max_rejoins: times this process registers again by itself after the server declared it failed
            while it was alive (default: the server's ``system.max_rejoins``).
        transport: ``"grpc"`` (default) or ``"tcp"``: the server's ``system.transport``, when ``address`` names none.

    Raises:
        SetupError: no token.
        grpc.RpcError: the server refused (wrong token: UNAUTHENTICATED; no free id: RESOURCE_EXHAUSTED)
            or was not there within ``connect_timeout_s`` (DEADLINE_EXCEEDED).
    """
    client = WorkerClient(
        address,
        token=token,
        worker_id=worker_id,
        tls_ca_file=tls_ca_file,
        connect_timeout_s=connect_timeout_s,
        max_rejoins=max_rejoins,
        transport=transport,
    )
    try:
        return client.open()
    except BaseException:
        client.transport.close()
        client._close_shards()
        raise


__all__ = ["IncarnationRevoked", "WorkerClient", "connect"]
