"""The gRPC face of a parameter-server driver: its service methods over the driver's transport-neutral calls.

A driver (:class:`src.parameter_server.ParameterServer`, a follower shard's
:class:`~src.ps.follower_server.FollowerServer`) has ``handle_register``, ``handle_push``, ``handle_pull``, ...;
:class:`GrpcMethods` gives it the service's methods (``Register``, ``Push``, ...) that
:func:`src.transport.grpc.service_handler` serves, each :class:`~src.ps.refusals.Refused` turned into the gRPC
status of the same name (:func:`refusals`). The TCP server (:mod:`src.ps.tcp_server`) calls the same ``handle_*``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import grpc

from src import parameter_server_pb2 as pb
from src.ps.refusals import Refused
from src.transport.wire import Pieces, serialize

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

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        with refusals(context):
            return self.handle_heartbeat(request)

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        with refusals(context):
            return self.handle_finish(request)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.handle_status()
