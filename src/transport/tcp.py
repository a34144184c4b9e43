"""The worker's client of the parameter server over the binary TCP transport (``system.transport: tcp``).

:class:`TCPParameterServerClient` has the interface of the gRPC client
(:class:`src.transport.grpc.ParameterServerClient`): the same calls, the same messages, the same
byte counters, emulated uplink and retries, and failures as :class:`~src.transport.errors.CallError`
(with gRPC's status names), so the worker, the library and the tools
choose a transport and nothing else (:func:`src.transport.clients.make_client`). The frames are
:mod:`src.transport.tcp_frames`'; the server is :mod:`src.transport.tcp_server`.

* **Connections.** A call takes an idle connection (one whose server has not closed it) or opens
  one: TCP (``TCP_NODELAY``, keepalive), TLS when the config has a CA or certificate to verify the
  server against (``system.tls_ca_file`` / ``tls_cert_file``, the gRPC transport's files), then a
  HELLO frame with the auth token. One call at a time per connection; the heartbeat thread's call
  and a push waiting at the barrier each have their own.
* **Deadlines.** A call's ``timeout`` bounds it end to end and travels in the frame, so the server
  stops waiting for work when the caller has given up. A passed deadline is ``DEADLINE_EXCEEDED``
  and closes that connection (its reply may still come).
* **Retries.** A call that failed in transport (``UNAVAILABLE``: the connection broke or could not
  be made; ``DEADLINE_EXCEEDED``) is sent again, the same bytes (a push keeps its request id, which
  the server applies at most once), after a backoff; ``wait_for_ready`` (Register) keeps trying to
  connect until the deadline, which carries a worker through a server restart.
* **Bytes.** ``bytes_sent`` / ``bytes_received`` count every frame, header included (hellos too); an
  emulated uplink (:class:`src.emulation.netem.Link`) makes every frame wait its transfer time before it goes out.
* **Zero copy.** A request's tensors are sent from their own memory (a gather write of the
  message's :class:`~src.transport.wire.Pieces`); a reply is read straight into one buffer whose views are the
  reply's tensors (:class:`~src.transport.wire.Received`).
"""

from __future__ import annotations

import itertools
import select
import socket
import ssl
import threading
import time
from typing import Any, Callable

from src import parameter_server_pb2 as pb
from src.config import SetupError, SystemConfig
from src.telemetry import tracing
from src.transport.protocol import ProtocolClient
from src.transport.settings import client_tls_roots, split_address
from src.transport.stream import PushStream, SliceStage, part_pieces, part_size
from src.transport.tcp_frames import (
    HEADER_BYTES,
    CallError,
    FrameError,
    Kind,
    Method,
    PeerClosed,
    error_of,
    new_body,
    pack_header,
    parse_header,
    receive_body,
    receive_exactly,
    receive_header,
    send_frame,
)
from src.transport.wire import Pieces, Received, encode, split

CLIENT_MAX_MESSAGE_BYTES = 2**31 - 1
"""Largest reply a client reads (the server is trusted; protobuf's ceiling)."""
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 2
"""An idle connection is probed after 30 s and given up after two unanswered probes (gRPC's keepalive
here is 30 s + 20 s): a vanished host is noticed even by a call waiting at the barrier."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Send and receive buffers of each connection: a few MB lets a large message stream without stalls."""
_MODEL_STATE = ("parameters", "buffers")


def _is_provisional(header) -> bool:
    return header.method == Method.PROVISIONAL and header.kind == Kind.REPLY


_REPLIES: dict[Method, tuple[Any, tuple[str, ...] | None]] = {
    Method.REGISTER: (pb.RegisterReply, None),
    Method.INITIALIZE: (pb.InitializeReply, None),
    Method.PULL: (pb.PullReply, _MODEL_STATE),
    Method.PUSH: (pb.PushReply, _MODEL_STATE + ("parameter_deltas",)),
    Method.HEARTBEAT: (pb.HeartbeatReply, None),
    Method.FINISH: (pb.FinishReply, None),
    Method.STATUS: (pb.StatusReply, None),
}


def tune_socket(sock: socket.socket) -> None:
    """Options both ends set on a connection: no Nagle delay, keepalive, large buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def client_tls_context(system: SystemConfig | None) -> ssl.SSLContext | None:
    """A TLS context verifying the server against ``tls_ca_file`` (else ``tls_cert_file``), or ``None``.

    Raises:
        SetupError: the file cannot be read or holds no certificate.
    """
    roots = client_tls_roots(system) if system is not None else None
    if roots is None:
        return None
    try:
        return ssl.create_default_context(cadata=roots.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise SetupError(f"system.tls_ca_file: not a PEM certificate ({exc})") from None


class _Connection:
    """One authenticated connection to the server."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.header = bytearray(HEADER_BYTES)
        self.staged = SliceStage()
        """Provisional slices that came on this connection outside a push's reply (``system.pipelined_replies``,
        a sharded server: a hold's, for the pull that follows it on this connection)."""

    def alive(self) -> bool:
        """An idle connection has nothing to read but provisional slices (a shard's, sent after a hold's
        acknowledgement); anything else readable means the server closed it (or broke it)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return True
            peeked = self.sock.recv(HEADER_BYTES, socket.MSG_PEEK)
            return len(peeked) == HEADER_BYTES and _is_provisional(parse_header(peeked))
        except (OSError, ValueError, FrameError):
            return False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TCPParameterServerClient(ProtocolClient):
    """A worker's (or a tool's) connection to a TCP-transport parameter server, counting the bytes it moves.

    Args:
        address: ``host:port`` of the server.
        token: the run's auth token (``None`` sends no HELLO: useful only to test refusal).
        system: TLS settings (``tls_ca_file`` / ``tls_cert_file``).
        connect_timeout_s: how long :meth:`register` waits for the server to come up.
        retries: extra attempts of a call that failed with UNAVAILABLE or DEADLINE_EXCEEDED.
        uplink: an emulated link (:class:`src.emulation.netem.Link`): every frame waits its transfer time, from
            its exact size, before it is sent.

    ``bytes_sent`` / ``bytes_received`` count every frame, heartbeats and hellos included; they are
    safe to read from another thread.
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
        try:
            self._host, self._port = split_address(address)
        except ValueError:
            raise SetupError(f"server address {address!r}: expected host:port") from None
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.uplink = uplink
        self.bytes_sent = 0
        self.bytes_received = 0
        self.closed = False
        self._token = token.encode() if token else None
        self._tls = client_tls_context(system)
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._calls = itertools.count(1)

    def close(self) -> None:
        """Close every connection; calls after this raise ``ValueError`` (as a closed gRPC channel's do)."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    # ------------------------------------------------------------------------- one attempt of a call

    def _attempt(self, name: str, request, *, timeout: float | None, wait_for_ready: bool):
        """One frame out, one back (retries are :class:`~src.transport.protocol.ProtocolClient`'s)."""
        method, pieces = Method[name.upper()], encode(request)
        if self.closed:
            raise ValueError("the client is closed")
        deadline = time.monotonic() + timeout if timeout is not None else None
        connection = self._connection(deadline, wait_for_ready)
        call = next(self._calls) & 0xFFFFFFFF
        deadline_ms = max(1, int(1000 * (deadline - time.monotonic()))) if deadline is not None else 0
        header = pack_header(Kind.REQUEST, method, len(pieces), call=call, deadline_ms=deadline_ms)
        reply_header, body = self._exchange(connection, header, pieces, deadline)
        if reply_header.call != call or reply_header.method != method:
            connection.close()
            raise CallError(
                "INTERNAL",
                f"the server answered call {reply_header.call} "
                f"({reply_header.method.name}) to call {call} ({method.name})",
            )
        self._release(connection, reply_header.closing)
        if reply_header.kind == Kind.ERROR:
            raise error_of(reply_header, body)
        reply_type, large_fields = _REPLIES[method]
        try:
            reply = split(body, reply_type, large_fields) if large_fields else reply_type.FromString(body)
        except Exception as exc:  # ValueError from split, protobuf's DecodeError
            raise CallError("INTERNAL", f"malformed {method.name} reply: {exc}") from None
        if method == Method.PULL:
            try:
                connection.staged.fill(reply)  # the parameters it leaves out: the slices this connection brought
            except (ValueError, IndexError) as exc:
                raise CallError("INTERNAL", f"PULL reply: {exc}") from None
        return reply

    def _exchange(self, connection: _Connection, header: bytes, pieces: Pieces, deadline: float | None):
        """Send one request frame and read its reply frame, counting and emulating; transport failures close
        the connection and become ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``."""
        sock = connection.sock
        size = HEADER_BYTES + len(pieces)
        with self._lock:
            self.bytes_sent += size
        if self.uplink is not None:  # emulation: the frame waits its transfer time before it leaves
            self.uplink.transmit(size)
        try:
            sock.settimeout(_remaining(deadline))
            with tracing.span("send", bytes=size):
                send_frame(sock, header, pieces.buffers)
            sock.settimeout(_remaining(deadline))
            with tracing.span("await_reply"):
                reply_header = self._past_slices(connection, connection.staged.add)
            if reply_header.length > CLIENT_MAX_MESSAGE_BYTES:
                raise FrameError("RESOURCE_EXHAUSTED", f"reply of {reply_header.length} bytes")
            with tracing.span("receive", bytes=reply_header.length):
                body = receive_body(sock, reply_header.length)
        except (OSError, PeerClosed, FrameError) as exc:
            raise self._broken(connection, exc) from None
        with self._lock:
            self.bytes_received += HEADER_BYTES + reply_header.length
        return reply_header, body

    def _past_slices(self, connection: _Connection, stage: Callable[[memoryview, int], None]):
        """The next frame's header on ``connection`` that is not a provisional slice; each slice before it
        (``system.pipelined_replies``: stepped before the barrier, the reply says whether it stands) is read and
        given to ``stage(its body, the frame's bytes)``, and counted as received."""
        sock = connection.sock
        header = receive_header(sock, connection.header)
        while _is_provisional(header):
            if header.length > CLIENT_MAX_MESSAGE_BYTES:
                raise FrameError("RESOURCE_EXHAUSTED", f"slice of {header.length} bytes")
            stage(receive_body(sock, header.length), HEADER_BYTES + header.length)
            with self._lock:
                self.bytes_received += HEADER_BYTES + header.length
            header = receive_header(sock, connection.header)
        return header

    def _broken(self, connection: _Connection, exc: BaseException) -> CallError:
        """Close ``connection`` after ``exc`` (a timeout, a bad frame, a lost connection): the call's error."""
        connection.close()
        if isinstance(exc, socket.timeout):
            return CallError("DEADLINE_EXCEEDED", f"no reply from {self.address} before the deadline")
        if isinstance(exc, FrameError):
            return CallError("UNAVAILABLE", f"bad frame from {self.address}: {exc.message}")
        return CallError("UNAVAILABLE", f"connection to {self.address} lost: {exc}")

    # ------------------------------------------------------------------------- a streamed push

    def _attempt_streamed(self, stream: PushStream, *, timeout: float | None) -> Received:
        """One attempt of a streamed push (:mod:`src.transport.stream`): a PUSH_PART frame per part as the stream
        hands it over, the PUSH frame (flag STREAMED), then the reply read into the stream's splitter as it
        arrives."""
        if self.closed:
            raise ValueError("the client is closed")
        deadline = time.monotonic() + timeout if timeout is not None else None
        connection = self._connection(deadline, False)
        call = next(self._calls) & 0xFFFFFFFF
        sock = connection.sock
        stream.attempt()
        connection.staged.clear()  # an earlier push's slices: its pull has come and gone
        try:
            for index, payload in stream.parts():
                pieces = part_pieces(index, payload)
                size = part_size(payload)
                self._send(stream, sock, pack_header(Kind.REQUEST, Method.PUSH_PART, size, call=call), pieces, size)
            request = encode(stream.request)
            deadline_ms = max(1, int(1000 * (deadline - time.monotonic()))) if deadline is not None else 0
            header = pack_header(
                Kind.REQUEST, Method.PUSH, len(request), call=call, deadline_ms=deadline_ms, streamed=True
            )
            self._send(stream, sock, header, request.buffers, len(request), deadline)
            sock.settimeout(_remaining(deadline))
            reply_header = self._past_slices(connection, stream.provisional)
            if reply_header.call != call or reply_header.method != Method.PUSH:
                raise FrameError(
                    "INTERNAL",
                    f"the server answered call {reply_header.call} ({reply_header.method.name}) to call {call} (PUSH)",
                )
            if reply_header.length > CLIENT_MAX_MESSAGE_BYTES:
                raise FrameError("RESOURCE_EXHAUSTED", f"reply of {reply_header.length} bytes")
            body = new_body(reply_header.length)
            size = HEADER_BYTES + reply_header.length
            if reply_header.kind == Kind.ERROR:
                receive_exactly(sock, body)
            else:
                splitter = stream.splitter(body, pb.PushReply, _REPLIES[Method.PUSH][1], size)
                receive_exactly(sock, body, splitter.advance)
                if stream.problem is not None:
                    raise FrameError("INTERNAL", f"PUSH reply: {stream.problem}")
        except (OSError, PeerClosed, FrameError) as exc:
            raise self._broken(connection, exc) from None
        except BaseException:  # the stream aborted, or its encode failed: the frames sent so far end with it
            connection.close()
            raise
        with self._lock:
            self.bytes_received += size
        if reply_header.kind != Kind.ERROR:  # a shard's hold: the slices its acknowledgement did not take, for the pull
            stream.unclaimed(connection.staged)
        self._release(connection, reply_header.closing)
        if reply_header.kind == Kind.ERROR:
            raise error_of(reply_header, body)
        try:
            return splitter.finish()
        except ValueError as exc:
            raise CallError("INTERNAL", f"malformed PUSH reply: {exc}") from None

    def _send(
        self, stream: PushStream, sock: socket.socket, header: bytes, pieces, size: int, deadline: float | None = None
    ) -> None:
        """One frame of a streamed push out, counted (and emulated, with an uplink) as every frame is."""
        with self._lock:
            self.bytes_sent += HEADER_BYTES + size
        stream.sent(HEADER_BYTES + size)
        if self.uplink is not None:
            self.uplink.transmit(HEADER_BYTES + size)
        sock.settimeout(_remaining(deadline))
        send_frame(sock, header, pieces)

    # ------------------------------------------------------------------------- connections

    def _connection(self, deadline: float | None, wait_for_ready: bool) -> _Connection:
        with self._lock:
            while self._idle:
                connection = self._idle.pop()
                if connection.alive():
                    return connection
                connection.close()
        backoff = 0.1
        while True:
            try:
                return self._connect(deadline)
            except CallError as exc:
                waiting = wait_for_ready and exc.code == "UNAVAILABLE" and not self.closed
                left = _remaining(deadline)
                if not waiting or (left is not None and left <= backoff):
                    if waiting:
                        raise CallError(
                            "DEADLINE_EXCEEDED",
                            f"{self.address} did not accept a connection before the deadline ({exc.message})",
                        ) from None
                    raise
                time.sleep(backoff)  # the server is (re)starting: try again until the deadline
                backoff = min(2 * backoff, 1.0)

    def _connect(self, deadline: float | None) -> _Connection:
        left = _remaining(deadline)
        try:
            raw = socket.create_connection((self._host, self._port), timeout=left if left is not None else 30.0)
        except socket.timeout:
            raise CallError("UNAVAILABLE", f"connecting to {self.address} timed out") from None
        except OSError as exc:
            raise CallError("UNAVAILABLE", f"cannot connect to {self.address}: {exc.strerror or exc}") from None
        try:
            tune_socket(raw)
            sock = self._tls.wrap_socket(raw, server_hostname=self._host) if self._tls is not None else raw
        except (ssl.SSLError, ssl.CertificateError, OSError) as exc:
            raw.close()
            raise CallError("UNAVAILABLE", f"TLS handshake with {self.address} failed: {exc}") from None
        connection = _Connection(sock)
        if self._token is not None:
            self._hello(connection, deadline)
        return connection

    def _hello(self, connection: _Connection, deadline: float | None) -> None:
        """Authenticate ``connection`` with the token (the server closes it on a wrong one)."""
        header = pack_header(Kind.REQUEST, Method.HELLO, len(self._token))
        reply_header, body = self._exchange(connection, header, Pieces((self._token,), len(self._token)), deadline)
        if reply_header.kind == Kind.ERROR:
            connection.close()
            raise error_of(reply_header, body)

    def _release(self, connection: _Connection, closing: bool) -> None:
        with self._lock:
            if not closing and not self.closed:
                self._idle.append(connection)
                return
        connection.close()


def _remaining(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (at least a millisecond: a socket timeout of 0 would mean non-blocking)."""
    return None if deadline is None else max(deadline - time.monotonic(), 1e-3)
