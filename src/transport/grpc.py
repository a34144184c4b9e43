"""gRPC plumbing of the parameter server: security, channels, message limits, tensor bytes, client.

What lives here is what both ends of the wire must agree on, so that :mod:`src.parameter_server`
and :mod:`src.worker` contain only their algorithms:

* **Auth.** Every RPC carries ``authorization: Bearer <token>`` metadata; the server's
  interceptor refuses anything else with ``UNAUTHENTICATED`` before a handler runs. The token comes
  from ``system.auth_token``, else ``$DTS_AUTH_TOKEN`` (:func:`resolve_auth_token`); the local
  launcher makes a random one per run. The one exception is the standard gRPC health service
  (``grpc.health.v1.Health``, registered by :func:`start_grpc_server`: ``SERVING`` while the server
  runs), which a probe (``python -m src.transport.healthcheck``, a container healthcheck, a load balancer)
  calls without the token: it tells nothing but whether the server is up.
* **TLS.** ``system.tls_cert_file`` + ``tls_key_file`` make the server speak TLS; a client uses TLS
  when it has ``tls_ca_file`` (or, for a self-signed server, ``tls_cert_file``) to verify against.
* **Message size.** gRPC refuses messages over 4 MB by default; a resnet18 is ~45 MB of float32.
  Both ends raise the limits instead of chunking: one unary message per pull and per push keeps the
  protocol simple (``scripts/bench_ps.py`` compares it with raw gRPC). The server sizes its receive
  limit from the model, so a client cannot make it buffer gigabytes.
* **Tensor bytes.** The messages' bytes are made and read by :mod:`src.transport.wire` (its names are
  re-exported here): the same bytes on every transport and on the virtual clock.
* **Counted client.** :class:`ParameterServerClient` serializes requests and parses replies itself,
  so ``bytes_sent`` / ``bytes_received`` are the lengths of the exact serialized messages that went
  through gRPC, and retries a call that failed in transport with the same request (a push keeps its
  request id, which the server applies at most once).
* **Streamed push** (``system.streaming``, :mod:`src.transport.stream`). ``PushStream`` is a bidi stream: the
  worker sends each gradient as a ``PushStreamRequest.part`` the moment backward produces it, then the push
  (``push``: a PushRequest without gradients); the server answers with the very PushReply bytes a ``Push``
  returns, in ``PushStreamReply`` chunks (:func:`reply_chunk_bounds`: small first, so the reply's head is out
  at once), the first carrying the reply's size. The client writes them into one buffer and walks it as it
  fills (:class:`~src.transport.wire.MessageSplitter`), so the verdict and each tensor are taken before the
  whole reply is in. Its bytes are counted as they cross gRPC, like every message. With
  ``system.pipelined_replies`` messages carrying a provisional slice each (``PushStreamReply.provisional``:
  :func:`provisional_message`) may come first, while the parts still go up; the reply's head says which stand
  (:meth:`PushStream.provisional <src.transport.stream.PushStream.provisional>`). A call names its likely caller in
  its metadata (:data:`PUSH_CALLER_METADATA_KEY`) so the server knows where to send them before the push says so.
* **Choosing a transport.** :func:`src.transport.clients.make_client` returns this client or the TCP
  transport's (:mod:`src.transport.tcp`, same interface) for ``system.transport``; the TLS files,
  token and limits above mean the same on both.
"""

from __future__ import annotations

import hmac
import threading
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from src import parameter_server_pb2 as pb
from src.config import SetupError, SystemConfig
from src.transport.errors import CallError
from src.transport.protocol import ProtocolClient
from src.transport.settings import AUTH_TOKEN_ENV, bound_socket, client_tls_roots, server_tls_files, split_address
from src.transport.stream import PROVISIONAL_HEAD, PushStream, part_pieces, part_size
from src.transport.wire import (  # noqa: F401  (re-exported: the message codec is part of this module's interface)
    Outgoing,
    Received,
    _varint,
    check_float32_bytes,
    copy_bytes_into,
    encode,
    field_number,
    serialize,
    split,
    tensor_to_bytes,
    tensor_view,
)

AUTH_METADATA_KEY = "authorization"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
"""The health service's methods answer without the auth token (see the module docstring)."""
# A client accepts whatever its server sends (the server is trusted); 2 GiB is protobuf's ceiling.
CLIENT_MAX_MESSAGE_BYTES = 2**31 - 1


PUSH_REPLY_LARGE_FIELDS = ("parameters", "buffers", "parameter_deltas")
"""A push reply's tensors: views of the reply, never parsed by protobuf."""
FIRST_REPLY_CHUNK_BYTES = 64 << 10
"""A streamed push's reply: bytes of its first chunk, which holds the head (verdict, version, work). Each chunk
after it is twice the one before, up to :data:`REPLY_CHUNK_BYTES`: the head and the first layers go out at once
on a slow link, and a large reply costs few messages."""
REPLY_CHUNK_BYTES = 1 << 20
"""A streamed push's reply: most bytes of reply in one ``PushStreamReply``."""
_REPLY_SIZE_TAG = _varint(field_number(pb.PushStreamReply, "reply_size") << 3 | 0)
_REPLY_TAG = _varint(field_number(pb.PushStreamReply, "reply") << 3 | 2)
_PROVISIONAL_TAG = _varint(field_number(pb.PushStreamReply, "provisional") << 3 | 2)
PUSH_STREAM_REPLY_LARGE_FIELDS = ("reply", "provisional")
"""A ``PushStreamReply``'s bytes fields: views of the message, never parsed by protobuf."""
PUSH_CALLER_METADATA_KEY = "dts-push-caller-bin"
"""``system.pipelined_replies``: a ``PushStream`` call's metadata naming the worker it is likely from (the serialized
``Caller`` of the client's last streamed push), so the server can send it provisional slices while the parts
arrive, before the push's own message says who it is (a wrong or stale one only costs that call its slices)."""


def reply_chunk_bounds(size: int) -> Iterator[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of a ``size``-byte reply that a streamed push's reply messages carry, in
    order (at least one: a reply of no bytes is one message with nothing but its size)."""
    start, length = 0, FIRST_REPLY_CHUNK_BYTES
    while True:
        end = min(size, start + length)
        yield start, end
        if end >= size:
            return
        start, length = end, min(2 * length, REPLY_CHUNK_BYTES)


def reply_chunk_prefix(start: int, end: int, size: int) -> bytes:
    """The protobuf bytes of a ``PushStreamReply`` carrying the reply's bytes ``[start, end)`` that come before
    those bytes: the reply's size (first chunk only), the chunk's tag and length (none for an empty chunk)."""
    head = _REPLY_SIZE_TAG + _varint(size) if start == 0 and size > 0 else b""
    return head + _REPLY_TAG + _varint(end - start) if end > start else head


def reply_stream_bytes(size: int) -> int:
    """Bytes of every ``PushStreamReply`` of a ``size``-byte reply, as they cross gRPC (what a client counts)."""
    return size + sum(len(reply_chunk_prefix(start, end, size)) for start, end in reply_chunk_bounds(size))


def provisional_message(version: int, index: int, start: int, values: Any) -> bytes:
    """The ``PushStreamReply`` carrying a provisional slice (``system.pipelined_replies``): parameter ``index``'s
    float32 ``values`` (a tensor) from element ``start``, stepped in the round of ``version``; their one copy."""
    head = PROVISIONAL_HEAD.pack(version, index, start)
    body = tensor_view(values)
    return b"".join((_PROVISIONAL_TAG, _varint(len(head) + len(body)), head, body))


PART_PIECE_BYTES = 128 << 10
"""A streamed push's part above this many bytes travels in pieces of at most this size (``part``, then
``part_more``): gRPC hands a server each message whole, so a large gradient's values reach it as they come only so
(what ``system.pipelined_replies`` steps slices from, as the TCP server reads a frame's bytes as they come)."""


def push_part_message(index: int, payload: Any) -> bytes:
    """The ``PushStreamRequest`` of a streamed push's part (gradient ``index``'s payload), whole."""
    return serialize(Outgoing(pb.PushStreamRequest(), {"part": [tuple(part_pieces(index, payload))]}))


def push_part_messages(index: int, payload: Any, pieced: bool = True) -> list[bytes]:
    """The ``PushStreamRequest`` messages of a streamed push's part: one, or (``pieced``) above
    :data:`PART_PIECE_BYTES` its pieces (the first with ``part_size``, the rest ``part_more``)."""
    size = part_size(payload)
    if size <= PART_PIECE_BYTES or not pieced:
        return [push_part_message(index, payload)]
    whole = memoryview(b"".join(part_pieces(index, payload)))
    first = pb.PushStreamRequest(part_size=size)
    messages = [serialize(Outgoing(first, {"part": [whole[:PART_PIECE_BYTES]]}))]
    for start in range(PART_PIECE_BYTES, size, PART_PIECE_BYTES):
        piece = whole[start : start + PART_PIECE_BYTES]
        messages.append(serialize(Outgoing(pb.PushStreamRequest(), {"part_more": [piece]})))
    return messages


def push_message(request: Outgoing) -> bytes:
    """The ``PushStreamRequest`` of a streamed push's own message (its small fields and buffers)."""
    return serialize(Outgoing(pb.PushStreamRequest(), {"push": [tuple(encode(request).buffers)]}))


# ----------------------------------------------------------------------------- security


def server_credentials(system: SystemConfig) -> grpc.ServerCredentials | None:
    """TLS credentials when ``tls_cert_file`` and ``tls_key_file`` are set, else ``None`` (plaintext).

    Raises:
        SetupError: only one of the two is set, or a file cannot be read.
    """
    files = server_tls_files(system)
    if files is None:
        return None
    cert, key = files
    return grpc.ssl_server_credentials([(key, cert)])


def channel_credentials(system: SystemConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials verifying the server against ``tls_ca_file`` (else ``tls_cert_file``), or ``None``."""
    roots = client_tls_roots(system)
    return grpc.ssl_channel_credentials(root_certificates=roots) if roots is not None else None


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing or wrong auth token (metadata '{AUTH_METADATA_KEY}: Bearer <token>'; "
                f"system.auth_token or ${AUTH_TOKEN_ENV})",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return continuation(handler_call_details)  # says only SERVING or not: no token needed
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):  # constant time: no timing oracle
                    return continuation(handler_call_details)
        return self._deny


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


KEEPALIVE_TIME_MS = 30_000
"""Both ends ping an idle connection this often, and the server accepts pings that often: without the
server's side of it, a client pinging during a long barrier wait earns a ``too_many_pings`` GOAWAY."""
KEEPALIVE_TIMEOUT_MS = 20_000


RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
"""A client retries a lost server at least every second (gRPC's default back-off grows to minutes): a
restarted server waits one heartbeat timeout for the workers of its checkpoint before it fails them."""


def keepalive_options(*, server: bool) -> list[tuple[str, int]]:
    """The keepalive settings of one end; the server's admit exactly the client's ping rate."""
    options = [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server:
        options += [
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS),
            ("grpc.http2.max_ping_strikes", 2),
        ]
    return options


def service_handler(servicer) -> grpc.GenericRpcHandler:
    """The ParameterServer service with this module's (de)serializers.

    Pull and Push return pre-serialized bytes (:func:`serialize`: the model's tensors are joined in
    without protobuf); Push and Initialize receive the raw request bytes so the handler can
    :func:`split` them and refuse a malformed one with INVALID_ARGUMENT. PushStream's messages travel as
    bytes both ways (the handler parses and builds them).
    """

    def unary(method, request_type, reply_type):
        return grpc.unary_unary_rpc_method_handler(
            method,
            request_deserializer=request_type.FromString if request_type is not None else None,
            response_serializer=serialize if reply_type is None else reply_type.SerializeToString,
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Register": unary(servicer.Register, pb.RegisterRequest, pb.RegisterReply),
            "Initialize": unary(servicer.Initialize, None, pb.InitializeReply),
            "Pull": unary(servicer.Pull, pb.PullRequest, None),
            "Push": unary(servicer.Push, None, None),
            "Heartbeat": unary(servicer.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatReply),
            "Finish": unary(servicer.Finish, pb.FinishRequest, pb.FinishReply),
            "Status": unary(servicer.Status, pb.StatusRequest, pb.StatusReply),
            "PushStream": grpc.stream_stream_rpc_method_handler(servicer.PushStream),
        },
    )


EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
"""gRPC binds with ``SO_REUSEPORT`` by default on Linux: a second server started for the same address (a shard's
twin, started by mistake beside it) would bind too, and the kernel would split new connections between the two.
Without it the second one cannot bind and stops with one line, as the TCP server's does."""


def start_grpc_server(
    servicer,
    system: SystemConfig,
    *,
    token: str,
    max_message_bytes: int,
    max_threads: int,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``servicer`` (see :func:`service_handler`) on ``system.server_address``.

    Returns the server and the bound port. The server also answers the standard health service
    (``grpc.health.v1.Health``): ``SERVING`` for the whole server (service ``""``) and for
    :data:`SERVICE_NAME` from the moment it has started.

    Port 0 binds a free port (reported back, for the launcher and tests).

    Raises:
        ValueError: bad TLS settings, or the address cannot be bound.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="ps-rpc"),
        interceptors=[TokenAuthInterceptor(token)],
        options=message_options(max_message_bytes) + keepalive_options(server=True) + [EXCLUSIVE_PORT],
    )
    server.add_generic_rpc_handlers([service_handler(servicer)])
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = server_credentials(system)
    address = system.server_address
    if split_address(address)[1] != 0:  # a port in use says so in one line (gRPC's own refusal logs its own first)
        bound_socket(address).close()
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise SetupError(f"system.server_address: cannot bind {address} ({exc})") from None
    if port == 0:
        raise SetupError(
            f"system.server_address: cannot bind {address} (in use, by another server for it, or not a local address)"
        )
    server.start()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, port


# ----------------------------------------------------------------------------- client


class ParameterServerClient(ProtocolClient):
    """A worker's (or a tool's) connection to the parameter server, counting the bytes it moves.

    Args:
        address: ``host:port`` of the server.
        token: the run's auth token (``None`` sends none: useful only to test refusal).
        system: TLS settings (``tls_ca_file`` / ``tls_cert_file``).
        connect_timeout_s: how long :meth:`register` waits for the server to come up.
        retries: extra attempts of a call that failed with UNAVAILABLE or DEADLINE_EXCEEDED.
        uplink: an emulated link (:class:`src.emulation.netem.Link`): every message waits its transfer time,
            from its exact serialized size, before it is sent.

    ``bytes_sent`` / ``bytes_received`` count every serialized message, heartbeats included; they
    are safe to read from another thread (each is one integer updated by one call at a time).
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None,
        system: SystemConfig | None = None,
        connect_timeout_s: float = 300.0,
        retries: int = 8,
        uplink: Any = None,
    ):
        options = message_options(CLIENT_MAX_MESSAGE_BYTES) + keepalive_options(server=False) + RECONNECT_OPTIONS
        credentials = channel_credentials(system) if system is not None else None
        if credentials is not None:
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.bytes_sent = 0
        self.bytes_received = 0
        self.uplink = uplink
        self._lock = threading.Lock()
        self._metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        self._push_caller: bytes | None = None  # the serialized Caller of the last streamed push (its hint)
        model_state = ("parameters", "buffers")
        self._calls = {
            name: self.channel.unary_unary(
                f"/{SERVICE_NAME}/{name}",
                request_serializer=self._serialize,
                response_deserializer=self._parser(reply_type, large_fields),
            )
            for name, reply_type, large_fields in (
                ("Register", pb.RegisterReply, None),
                ("Initialize", pb.InitializeReply, None),
                ("Pull", pb.PullReply, model_state),
                ("Push", pb.PushReply, PUSH_REPLY_LARGE_FIELDS),
                ("Heartbeat", pb.HeartbeatReply, None),
                ("Finish", pb.FinishReply, None),
                ("Status", pb.StatusReply, None),
            )
        }
        # a streamed push: its messages are made and read by _attempt_streamed, counted as they cross gRPC
        self._push_stream = self.channel.stream_stream(
            f"/{SERVICE_NAME}/PushStream", request_serializer=None, response_deserializer=self._received
        )

    def _serialize(self, outgoing) -> bytes:
        data = serialize(outgoing)
        with self._lock:
            self.bytes_sent += len(data)
        if self.uplink is not None:  # emulation: gRPC calls this in the caller's thread, before sending
            self.uplink.transmit(len(data))
        return data

    def _parser(self, reply_type, large_fields) -> Callable[[bytes], Any]:
        def parse(data: bytes):
            with self._lock:
                self.bytes_received += len(data)
            return split(data, reply_type, large_fields) if large_fields else reply_type.FromString(data)

        return parse

    def _attempt(self, name: str, request, *, timeout: float | None, wait_for_ready: bool):
        try:
            return self._calls[name](request, metadata=self._metadata, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise call_error(exc) from exc

    def _received(self, data: bytes) -> bytes:
        with self._lock:
            self.bytes_received += len(data)
        return data

    def _sending(self, stream: PushStream, data: bytes) -> bytes:
        """A streamed push's message about to go: counted (and emulated, with an uplink) as every message is."""
        with self._lock:
            self.bytes_sent += len(data)
        stream.sent(len(data))
        if self.uplink is not None:
            self.uplink.transmit(len(data))
        return data

    def _attempt_streamed(self, stream: PushStream, *, timeout: float | None) -> Received:
        """One attempt of a streamed push over ``PushStream`` (see the module docstring): each part as the stream
        hands it over (gRPC's request thread waits in :meth:`PushStream.parts` for backward), then the push; the
        reply's chunks written into one buffer as they come, walked by the stream's splitter."""
        stream.attempt()
        ended: list[BaseException] = []  # what stopped the parts (the stream aborted, an encode failed)
        started, outside = threading.Event(), threading.Event()  # the call is made; nobody waits in parts()
        outside.set()
        call: list[Any] = []
        turn = threading.Lock()
        over = [False]  # the attempt failed: its request thread takes no more parts

        def requests() -> Iterator[bytes]:
            parts = stream.parts()
            while True:
                with turn:
                    if over[0]:
                        return
                    outside.clear()
                try:
                    index, payload = next(parts)
                except StopIteration:
                    break
                except BaseException as exc:  # noqa: BLE001  (the worker's error: the call ends, and raises it)
                    ended.append(exc)
                    started.wait()
                    call[0].cancel()
                    return
                finally:
                    outside.set()
                for message in push_part_messages(index, payload, stream.pieced):
                    yield self._sending(stream, message)
            self._push_caller = _caller_hint(stream.request)
            yield self._sending(stream, push_message(stream.request))

        metadata = self._metadata
        if self._push_caller is not None:  # the server may send this call provisional slices while the parts come
            metadata += ((PUSH_CALLER_METADATA_KEY, self._push_caller),)
        responses = self._push_stream(requests(), metadata=metadata, timeout=timeout)
        call.append(responses)
        started.set()
        body = splitter = None
        filled = 0
        try:
            for data in responses:
                try:
                    chunk = split(data, pb.PushStreamReply, PUSH_STREAM_REPLY_LARGE_FIELDS)
                except ValueError as exc:
                    raise CallError("INTERNAL", f"malformed PushStream reply: {exc}") from None
                if chunk.large["provisional"]:  # system.pipelined_replies: the reply's head says whether it stands
                    stream.provisional(_provisional_body(chunk, splitter is not None), len(data))
                    continue
                if splitter is None:
                    size = chunk.message.reply_size
                    if size > CLIENT_MAX_MESSAGE_BYTES:
                        raise CallError("RESOURCE_EXHAUSTED", f"reply of {size} bytes")
                    body = memoryview(np.empty(size, dtype=np.uint8))  # no zero-fill: every byte is written
                    splitter = stream.splitter(body, pb.PushReply, PUSH_REPLY_LARGE_FIELDS, reply_stream_bytes(size))
                for piece in chunk.large["reply"]:
                    if filled + len(piece) > len(body):
                        raise CallError("INTERNAL", f"the reply runs past its {len(body)} bytes")
                    body[filled : filled + len(piece)] = piece
                    filled += len(piece)
                splitter.advance(filled)
        except grpc.RpcError as exc:
            responses.cancel()
            failed = call_error(exc)
            if failed.retryable:
                # gRPC's request thread may still wait in parts() for the next gradient: it takes that one (into
                # stream.encoded, which a retry sends first) before a retry's own thread reads the parts
                with turn:
                    over[0] = True
                outside.wait()
            if ended:
                raise ended[0] from None
            raise failed from exc
        except BaseException:  # the worker's on_large failed: the call ends with it
            responses.cancel()
            raise
        if ended:
            raise ended[0]
        if stream.problem is not None:  # the head named a slice that did not come: sent again, answered whole
            raise CallError("UNAVAILABLE", f"PushStream reply: {stream.problem}")
        if splitter is None or filled < len(body):
            raise CallError(
                "INTERNAL",
                f"the PushStream reply ended after {filled} of {len(body) if body is not None else '?'} bytes",
            )
        try:
            return splitter.finish()
        except ValueError as exc:
            raise CallError("INTERNAL", f"malformed PushStream reply: {exc}") from None

    def close(self) -> None:
        self.channel.close()


def call_error(exc: grpc.RpcError) -> CallError:
    """A failed gRPC call as the transport-neutral :class:`~src.transport.errors.CallError` (its status's name)."""
    code = exc.code()
    return CallError(code.name if code is not None else "UNKNOWN", exc.details() or str(exc))


def _caller_hint(request: Outgoing) -> bytes | None:
    """The serialized ``Caller`` of a streamed push's message: the next ``PushStream`` call's likely caller."""
    caller = getattr(request.message, "caller", None)
    return caller.SerializeToString() if caller is not None and caller.ByteSize() else None


def _provisional_body(chunk: Received, reply_begun: bool) -> memoryview:
    """The provisional slice of a ``PushStreamReply`` (its head and values, a view of the message).

    Raises:
        CallError: the message also carries reply fields, the reply has begun, or the slice has no head.
    """
    body = chunk.large["provisional"][0]
    if reply_begun or chunk.large["reply"] or chunk.message.reply_size:
        raise CallError("INTERNAL", "a PushStream reply's provisional slice came with its reply")
    if len(body) < PROVISIONAL_HEAD.size:
        raise CallError("INTERNAL", f"a provisional slice of {len(body)} bytes has no head")
    return body
