"""The gRPC face of a parameter-server driver: its service methods over the driver's transport-neutral calls.

A driver (:class:`src.parameter_server.ParameterServer`, a follower shard's
:class:`~src.ps.follower_server.FollowerServer`) has ``handle_register``, ``handle_push``, ``handle_pull``, ...;
:class:`GrpcMethods` gives it the service's methods (``Register``, ``Push``, ...) that
:func:`src.transport.grpc.service_handler` serves, each :class:`~src.ps.refusals.Refused` turned into the gRPC
status of the same name (:func:`refusals`). The TCP server (:mod:`src.ps.tcp_server`) calls the same ``handle_*``.

``PushStream`` (``system.streaming``) is a streamed push over gRPC: each part goes to the driver's ``push_parts``
(:class:`~src.ps.push_parts.PushParts`: checked and decoded as it arrives, on the call's thread), the push's own
message then to ``handle_push`` as :meth:`PushParts.assemble <src.ps.push_parts.PushParts.assemble>` makes it; the
reply (the same bytes ``Push`` answers) goes back in ``PushStreamReply`` chunks straight from its pieces
(:func:`reply_messages`; the parameters' lease given back once the last chunk is made). What is wrong with a part
refuses the push when its message comes, as on TCP; a message that is not a ``PushStreamRequest`` refuses it at once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol

import grpc

from src import parameter_server_pb2 as pb
from src.ps.refusals import Refused
from src.transport.grpc import reply_chunk_bounds, reply_chunk_prefix
from src.transport.wire import Pieces, SharedRef, serialize, split

PUSH_LARGE_FIELDS = ("gradients", "buffers")  # a push's tensors: views of the message, never parsed by protobuf


@contextlib.contextmanager
def refusals(context: grpc.ServicerContext) -> Iterator[None]:
    """Turn the core's :class:`~src.ps.refusals.Refused` into the gRPC status of the same name."""
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

    def __init__(self, context: grpc.ServicerContext):
        self.context = context
        self.peer = context.peer()

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
    shard's server (:class:`src.ps.follower_server.FollowerServer`) serve over gRPC."""

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
        reply = None
        try:
            with refusals(context):
                reply = self.handle_push(self._streamed_push(messages, context), GrpcCall(context))
            yield from reply_messages(reply)
        finally:
            if isinstance(reply, Pieces):
                reply.release()
            self.after_reply()

    def _streamed_push(self, messages: Iterator[bytes], context: grpc.ServicerContext):
        """Read a streamed push's messages: each part to the driver's ``push_parts`` as it comes; returns the push
        assembled (``handle_push``'s argument) once its own message is in."""
        push_parts = getattr(self, "push_parts", None)
        if push_parts is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server does not take streamed pushes")
        parts = push_parts(self.core.model.max_message_bytes)
        for data in messages:
            try:
                message = split(data, pb.PushStreamRequest, ("part", "push"))
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"push stream: {exc}")
            part, push = message.large["part"], message.large["push"]
            if len(part) + len(push) != 1:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"push stream: a message carries a part or the push, not {len(part)} parts, {len(push)} pushes",
                )
            if push:
                return parts.assemble(push[0])
            parts.add(part[0])
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push stream: it ended before the push's message")

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        with refusals(context):
            return self.handle_heartbeat(request)

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        with refusals(context):
            return self.handle_finish(request)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.handle_status()
