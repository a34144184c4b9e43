"""The gRPC face of a parameter-server driver: its service methods over the driver's transport-neutral calls.

A driver (:class:`src.parameter_server.ParameterServer`, a follower shard's
:class:`~src.ps.shards.follower_server.FollowerServer`) has ``handle_register``, ``handle_push``, ``handle_pull``, ...;
:class:`GrpcMethods` gives it the service's methods (``Register``, ``Push``, ...) that
:func:`src.transport.grpc.service_handler` serves, each :class:`~src.ps.state.refusals.Refused` turned into the gRPC
status of the same name (:func:`refusals`). The TCP server (:mod:`src.transport.tcp_server`) calls the same
``handle_*``.

``PushStream`` (``system.streaming``) is a streamed push over gRPC: each part goes to the driver's ``push_parts``
(:class:`~src.ps.state.streamed_parts.PushParts`: checked and decoded as it arrives, on the call's thread), the push's
own message then to ``handle_push`` as :meth:`PushParts.assemble <src.ps.state.streamed_parts.PushParts.assemble>` makes
it; the reply (the same bytes ``Push`` answers) goes back in ``PushStreamReply`` chunks straight from its pieces
(:func:`reply_messages`; the parameters' lease given back once the last chunk is made). What is wrong with a part
refuses the push when its message comes, as on TCP; a message that is not a ``PushStreamRequest`` refuses it at once.

With ``system.pipelined_replies`` (a driver whose ``pipelined`` is true) the call also sends provisional slices
(:mod:`src.ps.state.slice_pipeline`) while the parts still come and while it waits at the barrier: the push is read and
handled on a thread of the call's own, and the handler yields what the call's :class:`~src.transport.grpc_sink.GrpcSink`
queues, then the reply (or raises the refusal, on the handler's thread). A call does not say whose push it carries until
its last message, so the client names its likely caller in the call's metadata
(:data:`~src.transport.grpc.PUSH_CALLER_METADATA_KEY`: its last streamed push's); if that is a live member's session,
the worker is attached to this call's sink before the parts are read (:meth:`SlicePipeline.attach
<src.ps.state.slice_pipeline.SlicePipeline.attach>`), so its values are reported as they come and its slices come here.
A wrong name costs that call its slices only: each sink is one call's, and a reply leaves out only what went on its own
call (and the barrier checks every slice).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Protocol

import grpc

from src import parameter_server_pb2 as pb
from src.transport.errors import Refused
from src.transport.grpc import PUSH_CALLER_METADATA_KEY, reply_chunk_bounds, reply_chunk_prefix
from src.transport.grpc_sink import GrpcSink
from src.transport.wire import Pieces, SharedRef, serialize, split

PUSH_LARGE_FIELDS = ("gradients", "buffers")  # a push's tensors: views of the message, never parsed by protobuf


@contextlib.contextmanager
def refusals(context: grpc.ServicerContext) -> Iterator[None]:
    """Turn the core's :class:`~src.ps.state.refusals.Refused` into the gRPC status of the same name."""
    try:
        yield
    except Refused as refused:
        context.abort(grpc.StatusCode[refused.code], refused.message)


class Call(Protocol):
    """What a transport tells the driver about one call in progress."""

    peer: str
    """The caller's address, as gRPC writes it (``ipv4:10.0.0.2:51234``)."""
    framing_bytes: int
    """The transport's own bytes around a reply message (a frame header), counted on an emulated downlink."""

    def is_active(self) -> bool:
        """``False`` once the caller went away or its deadline passed: a waiting call stops waiting."""


class GrpcCall:
    """A gRPC call in progress, as a driver sees it (:class:`Call`)."""

    framing_bytes = 0  # gRPC's own framing is not counted (the byte counters count messages)

    def __init__(self, context: grpc.ServicerContext, sink: GrpcSink | None = None):
        self.context = context
        self.peer = context.peer()
        self.sink = sink  # system.pipelined_replies: the call's provisional slices

    def is_active(self) -> bool:
        return self.context.is_active()


def joined(reply: Pieces | bytes) -> bytes:
    """gRPC sends ``bytes``: the reply's pieces joined (one copy, outside the core's lock), its lease given back
    (a reply that is bytes already, e.g. a sharded server's acknowledgement, as it is)."""
    if isinstance(reply, bytes):
        return reply
    try:
        return serialize(reply)
    finally:
        reply.release()


def reply_messages(reply: Pieces | bytes) -> Iterator[bytes]:
    """A streamed push's reply as the ``PushStreamReply`` messages that carry it
    (:func:`~src.transport.grpc.reply_chunk_bounds`), each made from the reply's pieces in one copy (a piece of the
    parameters' shared memory read with its lock held, one chunk at a time). The caller releases ``reply``."""
    pieces = reply.buffers if isinstance(reply, Pieces) else (reply,)
    shared = reply.shared if isinstance(reply, Pieces) else None
    size = len(reply)
    queue = iter(pieces)
    piece: Any = None
    piece_bytes = offset = 0  # the piece being read, its size, and how much of it is taken
    for start, end in reply_chunk_bounds(size):
        wanted: list[tuple[Any, int, int]] = []  # (piece, from, to) making this chunk
        need = end - start
        while need:
            if offset == piece_bytes:
                piece = next(queue)
                piece_bytes = piece.nbytes if isinstance(piece, SharedRef) else memoryview(piece).nbytes
                offset = 0
            take = min(need, piece_bytes - offset)
            wanted.append((piece, offset, offset + take))
            offset += take
            need -= take
        prefix = reply_chunk_prefix(start, end, size)
        if shared is not None and any(isinstance(p, SharedRef) for p, _, _ in wanted):
            with shared.lock:  # held for one chunk's copy, never while gRPC sends it
                message = _joined(prefix, wanted, shared)
        else:
            message = _joined(prefix, wanted, None)
        yield message


def _joined(prefix: bytes, wanted: list, shared) -> bytes:
    views = [(shared.view(p.index) if isinstance(p, SharedRef) else memoryview(p).cast("B"))[a:b] for p, a, b in wanted]
    return b"".join([prefix, *views])


class GrpcMethods:
    """The gRPC service's methods (:func:`src.transport.grpc.service_handler`) over a driver's ``handle_*`` calls,
    each refusal turned into the call's status: what :class:`src.parameter_server.ParameterServer` and a follower
    shard's server (:class:`src.ps.shards.follower_server.FollowerServer`) serve over gRPC."""

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        with refusals(context):
            return self.handle_register(request, context.peer())

    def Initialize(self, data: bytes, context: grpc.ServicerContext) -> pb.InitializeReply:
        with refusals(context):
            return self.handle_initialize(data)

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes:
        with refusals(context):
            return joined(self.handle_pull(request, GrpcCall(context)))

    def Push(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        with refusals(context):
            try:
                return joined(self.handle_push(data, GrpcCall(context)))
            finally:
                self.after_reply()  # gRPC sends the reply after this returns: as late as this transport allows

    def PushStream(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """A streamed push (see the module docstring): its parts, then its message; the reply in chunks."""
        if getattr(self, "pipelined", False):
            yield from self._pipelined_push_stream(messages, context)
            return
        reply = None
        try:
            with refusals(context):
                reply = self.handle_push(self._streamed_push(messages), GrpcCall(context))
            yield from reply_messages(reply)
        finally:
            if isinstance(reply, Pieces):
                reply.release()
            self.after_reply()

    def _pipelined_push_stream(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """A streamed push that sends provisional slices (see the module docstring): the push read and handled on
        a thread of its own; here, the slices as they are queued, then the reply in chunks."""
        sink = GrpcSink()
        threading.Thread(
            target=self._handle_stream, args=(messages, context, sink), name="ps-push-stream", daemon=True
        ).start()
        reply = None
        try:
            with refusals(context):  # the handling's refusal, aborted on this (the handler's) thread
                reply = yield from sink.messages()
            self.sent_provisional(sink.take_sent())
            yield from reply_messages(reply)
        finally:
            sink.close()
            self.sent_provisional(sink.take_sent())  # slices out before the call failed
            if isinstance(reply, Pieces):
                reply.release()
            self.after_reply()

    def _handle_stream(self, messages: Iterator[bytes], context: grpc.ServicerContext, sink: GrpcSink) -> None:
        """The thread of a pipelined ``PushStream``: attach the worker the call names, read the push, handle it;
        what comes of it (the reply or the exception) goes to ``sink``."""
        try:
            self._attach_named(context, sink)
            reply = self.handle_push(self._streamed_push(messages, sink), GrpcCall(context, sink))
        except BaseException as exc:  # noqa: BLE001  (raised again on the handler's thread)
            sink.end(error=exc)
        else:
            sink.end(reply)

    def _attach_named(self, context: grpc.ServicerContext, sink: GrpcSink) -> None:
        """Attach the worker a call's metadata names (:data:`~src.transport.grpc.PUSH_CALLER_METADATA_KEY`) to
        ``sink``, if it is a live member's session: its values are reported and its slices sent here from now on."""
        named = next((v for k, v in context.invocation_metadata() or () if k == PUSH_CALLER_METADATA_KEY), None)
        pipeline = self.core.pipeline
        if named is None or pipeline is None:
            return
        try:
            caller = pb.Caller.FromString(named)
            with self.core.lock:
                self.core.member(caller)
        except Exception:  # noqa: BLE001  (not a live member's session, or not a Caller: no slices on this call)
            return
        pipeline.attach(caller.worker_id, sink)

    def _streamed_push(self, messages: Iterator[bytes], sink: GrpcSink | None = None):
        """Read a streamed push's messages: each part to the driver's ``push_parts`` as it comes (its values
        reported to the slice pipeline through ``sink``); returns the push assembled (``handle_push``'s argument)
        once its own message is in.

        Raises:
            Refused: the driver takes no streamed pushes, or a message is malformed or the stream ended early.
        """
        push_parts = getattr(self, "push_parts", None)
        if push_parts is None:
            raise Refused("UNIMPLEMENTED", "this server does not take streamed pushes")
        parts = push_parts(self.core.model.max_message_bytes, sink)
        piecing = None  # a part arriving in pieces: [its buffer, bytes in]
        for data in messages:
            try:
                message = split(data, pb.PushStreamRequest, ("part", "push", "part_more"))
            except ValueError as exc:
                raise Refused("INVALID_ARGUMENT", f"push stream: {exc}") from None
            part, push, more = message.large["part"], message.large["push"], message.large["part_more"]
            if len(part) + len(push) + len(more) != 1:
                raise Refused(
                    "INVALID_ARGUMENT",
                    f"push stream: a message carries a part, a piece or the push, not {len(part)} parts, "
                    f"{len(more)} pieces, {len(push)} pushes",
                )
            if piecing is not None and not more:
                raise Refused("INVALID_ARGUMENT", f"push stream: a part ended after {piecing[1]} of its bytes")
            if push:
                return parts.assemble(push[0])
            if more:
                if piecing is None:
                    raise Refused("INVALID_ARGUMENT", "push stream: a piece of a part came with no part before it")
                piecing = _piece(parts, piecing, more[0])
            elif message.message.part_size:
                piecing = _first_piece(parts, message.message.part_size, part[0])
            else:
                parts.add(part[0])
                parts.progress(part[0], len(part[0]))  # a part comes whole: its values are all in (checked by add)
        raise Refused("INVALID_ARGUMENT", "push stream: it ended before the push's message")

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        with refusals(context):
            return self.handle_heartbeat(request)

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        with refusals(context):
            return self.handle_finish(request)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.handle_status()


def _first_piece(parts, size: int, piece) -> list | None:
    """A part that travels in pieces begins (``size``: its whole size, ``piece``: its first bytes): its buffer, with
    what is in so far (``None`` once the part is whole).

    Raises:
        Refused: ``size`` exceeds what the push may still hold, or the first piece is larger than the part.
    """
    room = parts.max_bytes - parts.nbytes
    if size > room or len(piece) > size:
        raise Refused(
            "INVALID_ARGUMENT", f"push stream: a part of {size} bytes (its first piece {len(piece)}, room {room})"
        )
    buffer = memoryview(bytearray(size))
    buffer[: len(piece)] = piece
    return _piece(parts, [buffer, 0], piece, copied=True)


def _piece(parts, piecing: list, piece, *, copied: bool = False) -> list | None:
    """The next ``piece`` of the part being pieced together (``copied``: already in its buffer): its values reported as
    they come (:meth:`PushParts.progress <src.ps.state.streamed_parts.PushParts.progress>`), the part taken once whole.
    """
    buffer, filled = piecing
    if filled + len(piece) > len(buffer):
        raise Refused("INVALID_ARGUMENT", f"push stream: a part's pieces run past its {len(buffer)} bytes")
    if not copied:
        buffer[filled : filled + len(piece)] = piece
    filled += len(piece)
    parts.progress(buffer, filled)
    if filled < len(buffer):
        return [buffer, filled]
    parts.add(buffer)
    return None
