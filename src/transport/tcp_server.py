"""The parameter server's TCP transport: binary frames (:mod:`src.transport.tcp_frames`) into the server's calls.

:class:`TCPServer` moves frames and nothing else: every call goes to the driver's transport-neutral
``handle_*`` methods (:class:`src.parameter_server.ParameterServer`, which takes the core's lock,
decodes pushes outside it, waits for work, emulates downlinks), so a gRPC and a TCP server cannot
decide differently. What it adds is what a socket server must do itself:

* **One thread per connection** (a worker has two: its training calls, its heartbeats), reading one
  frame at a time: the header into a fixed buffer, checked against the limit of its method
  (:data:`~src.transport.tcp_frames.HELLO_MAX_BYTES` before authentication, :data:`SMALL_MESSAGE_BYTES` for
  the small calls, the model-sized ``max_message_bytes`` for Push and Initialize) *before* the
  body's buffer exists; an oversized or malformed frame is answered (``RESOURCE_EXHAUSTED`` /
  ``INVALID_ARGUMENT``) and the connection closed, since the next frame cannot be found.
* **Auth**: the first frame must be a HELLO carrying the run's token (compared in constant time);
  anything else is refused with ``UNAUTHENTICATED`` and the connection closed. A connection has
  :data:`AUTH_TIMEOUT_S` to get there (TLS handshake included). HEALTH needs no token and says only
  ``SERVING`` (as the gRPC health service). Sessions are the core's: every call carries its Caller.
* **TLS** with ``ssl`` and the config's ``tls_cert_file`` / ``tls_key_file`` (the gRPC transport's files).
* **Deadlines and cancellation**: a call waiting for work stops (``CANCELLED``) when its caller's
  deadline, sent in the frame, has passed or the caller closed the connection.
* **Replies** are the core's :class:`~src.transport.wire.Pieces`: the parameters' own memory
  (:class:`~src.transport.wire.SharedBuffers`, copied only if the next step comes while a reply is still on the
  wire), written outside the core's lock in gather writes.
* **Limits on connections**: at most ``max_connections`` at a time; one more is answered
  ``RESOURCE_EXHAUSTED`` and closed.
* **Pipelined replies** (``system.pipelined_replies``, :mod:`src.ps.state.slice_pipeline`): a streamed push's parts are
  read as their bytes come, so the pipeline sees a gradient's values arrive; each connection has a
  :class:`~src.transport.tcp_sink.TCPSink` whose writer thread sends the provisional slices, and the connection's
  replies go out after them, under the same write lock.
"""

from __future__ import annotations

import hmac
import logging
import select
import socket
import ssl
import threading
import time
from contextlib import contextmanager
from functools import partial
from typing import Any

from src import parameter_server_pb2 as pb
from src.config import SetupError, SystemConfig
from src.telemetry import tracing
from src.transport.errors import Refused
from src.transport.settings import bound_socket, server_tls_files
from src.transport.tcp import tune_socket
from src.transport.tcp_frames import (
    HEADER_BYTES,
    HELLO_MAX_BYTES,
    PUSH_READ_BYTES,
    FrameError,
    Kind,
    Method,
    PeerClosed,
    new_body,
    pack_header,
    peer_name,
    receive_body,
    receive_exactly,
    receive_header,
    send_error,
    send_frame,
)
from src.transport.tcp_sink import TCPSink
from src.transport.wire import encode

logger = logging.getLogger(__name__)

SMALL_MESSAGE_BYTES = 1 << 20
"""Limit of a Register, Pull, Heartbeat, Finish or Status request: they carry no tensors."""
AUTH_TIMEOUT_S = 10.0
"""Seconds a new connection has for its TLS handshake and HELLO."""
BODY_TIMEOUT_S = 60.0
"""Seconds a frame's body may go without a byte arriving before the connection is dropped."""
DEADLINE_GRACE_S = 0.5
"""A waiting call stops this long after its caller's deadline (the caller has closed the connection by then)."""
ACCEPT_POLL_S = 0.25
"""The accepting thread wakes this often to notice :meth:`TCPServer.stop`."""
_TENSOR_METHODS = (Method.PUSH, Method.PUSH_PART, Method.INITIALIZE)


class _TCPCall:
    """One call in progress, as the driver sees it (:class:`src.parameter_server.Call`)."""

    framing_bytes = HEADER_BYTES

    def __init__(self, sock: socket.socket, peer: str, deadline_ms: int, sink: TCPSink | None = None):
        self.sock = sock
        self.peer = peer
        self.sink = sink  # system.pipelined_replies: the connection's provisional slices
        # A little after the caller's own deadline: the caller gives up first and sees DEADLINE_EXCEEDED.
        self.deadline = time.monotonic() + deadline_ms / 1000 + DEADLINE_GRACE_S if deadline_ms else None

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def is_active(self) -> bool:
        if self.expired():
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return True
            if isinstance(self.sock, ssl.SSLSocket):
                return False  # a client sends nothing during a call: a readable TLS socket is its close
            return self.sock.recv(1, socket.MSG_PEEK) != b""  # b"": the caller closed the connection
        except (OSError, ValueError):
            return False


class TCPServer:
    """Serves a driver's calls (``handle_register``, ``handle_push``, ...) over TCP frames; see the module docstring.

    Args:
        driver: the :class:`~src.parameter_server.ParameterServer` whose calls these are.
        system: ``server_address`` and the TLS files.
        token: the auth token a HELLO must carry.
        max_message_bytes: limit of a Push or Initialize frame's body.
        max_connections: connections served at a time.

    Raises:
        SetupError: bad TLS settings (:meth:`start`: the address cannot be bound).
    """

    def __init__(self, driver, system: SystemConfig, *, token: str, max_message_bytes: int, max_connections: int):
        self.driver = driver
        self.address = system.server_address
        self.max_message_bytes = max_message_bytes
        self.max_connections = max_connections
        self._token = token.encode()
        self._tls = _server_tls_context(system)
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._connections: dict[socket.socket, bool] = {}  # socket -> busy in a call
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> int:
        """Listen on ``system.server_address`` (port 0: a free one); returns the bound port."""
        listener = bound_socket(self.address)
        try:
            listener.listen(128)
        except OSError as exc:
            listener.close()
            reason = exc.strerror or exc
            raise SetupError(f"system.server_address: cannot listen on {self.address} ({reason})") from None
        listener.settimeout(ACCEPT_POLL_S)
        self._listener = listener
        self._accepting = threading.Thread(target=self._accept, name="ps-tcp-accept", daemon=True)
        self._accepting.start()
        return listener.getsockname()[1]

    def stop(self, grace: float = 2.0) -> None:
        """Accept no more connections; give calls in progress ``grace`` seconds, then close every connection."""
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread now (Linux)
            except OSError:
                pass
        if self._accepting is not None:
            self._accepting.join(5)
        if self._listener is not None:
            self._listener.close()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with self._lock:
                if not any(self._connections.values()):
                    break
            time.sleep(0.02)  # calls in progress end on their own (the core has stopped their waits)
        with self._lock:
            sockets = list(self._connections)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the connection's thread, which closes it
            except OSError:
                pass

    def open_connections(self) -> int:
        """Connections served now (each has its thread)."""
        with self._lock:
            return len(self._connections)

    # ------------------------------------------------------------------------- connections

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                continue  # e.g. EMFILE: the next accept may succeed
            with self._lock:
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections[sock] = False
            if full:
                self._refuse_connection(sock)
                continue
            threading.Thread(
                target=self._serve, args=(sock, peer_name(address)), name="ps-tcp-connection", daemon=True
            ).start()

    def _refuse_connection(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(1.0)
            if self._tls is None:  # over TLS the client could not read a plaintext frame
                send_error(
                    sock,
                    Method.HELLO,
                    0,
                    "RESOURCE_EXHAUSTED",
                    f"the server serves {self.max_connections} connections at a time",
                    closing=True,
                )
        except OSError:
            pass
        finally:
            sock.close()

    def _serve(self, raw: socket.socket, peer: str) -> None:
        sock = raw
        sink = None  # system.pipelined_replies: the connection's provisional slices (plaintext: the config refuses TLS)
        try:
            tune_socket(raw)
            raw.settimeout(AUTH_TIMEOUT_S)
            if self._tls is not None:
                sock = self._tls.wrap_socket(raw, server_side=True)
            elif getattr(self.driver, "pipelined", False):
                sink = TCPSink(sock)
            self._frames(sock, raw, peer, sink)
        except (OSError, PeerClosed) as exc:  # the client went away, a TLS handshake failed, a timeout
            logger.debug("tcp connection from %s ended: %s", peer, exc)
        finally:
            if sink is not None:
                sink.close()
            with self._lock:
                self._connections.pop(raw, None)
            sock.close()

    def _frames(self, sock: socket.socket, raw: socket.socket, peer: str, sink: TCPSink | None) -> None:
        """Answer the connection's frames one at a time until it closes or breaks the protocol."""
        header_buffer = bytearray(HEADER_BYTES)
        authenticated = False
        parts, parts_call = None, 0  # a streamed push arriving on this connection (its PUSH_PART frames so far)
        while not self._stopping.is_set():
            try:
                header = receive_header(sock, header_buffer)
                limit = self._limit(header.method, authenticated)
                if header.kind != Kind.REQUEST:
                    raise FrameError("INVALID_ARGUMENT", f"a client sends requests, not {header.kind.name}")
                if not authenticated and header.method not in (Method.HELLO, Method.HEALTH):
                    raise FrameError("UNAUTHENTICATED", _NO_TOKEN)
                if header.length > limit:
                    raise FrameError(
                        "RESOURCE_EXHAUSTED",
                        f"{header.method.name} frame of {header.length} bytes exceeds the limit of {limit} bytes",
                    )
            except PeerClosed:
                return
            except FrameError as refused:
                method, call = _echoed(header_buffer)
                send_error(sock, method, call, refused.status, refused.message, closing=True)
                return
            sock.settimeout(BODY_TIMEOUT_S)
            if header.method == Method.PUSH_PART:  # a streamed push's gradient: decoded now, answered with the push
                if parts is None or parts_call != header.call:
                    parts, parts_call = self.driver.push_parts(self.max_message_bytes, sink), header.call
                part = new_body(header.length)
                if parts.arriving is not None:  # pipelined: what each read brings is reported as arrived
                    receive_exactly(sock, part, partial(parts.progress, part))
                else:
                    receive_exactly(sock, part, read_bytes=PUSH_READ_BYTES)
                parts.add(part)
                sock.settimeout(None)
                continue
            if header.method == Method.PUSH and header.streamed:
                if parts is None or parts_call != header.call:  # a streamed push of no gradient (a skipped step)
                    parts = self.driver.push_parts(self.max_message_bytes)
                body = parts.assemble(receive_body(sock, header.length))
            elif header.method == Method.PUSH:  # its gradients are decoded as they arrive (still in the cache)
                body = self.driver.push_splitter(new_body(header.length))
                with tracing.span("receive", bytes=header.length):
                    receive_exactly(sock, body.view, body.advance, read_bytes=PUSH_READ_BYTES)
            else:
                body = receive_body(sock, header.length)
            if header.method == Method.PUSH:
                parts = None
            with self._lock:
                self._connections[raw] = True
            try:
                if header.method == Method.HELLO:
                    if not hmac.compare_digest(bytes(body), self._token):  # constant time: no timing oracle
                        send_error(sock, Method.HELLO, header.call, "UNAUTHENTICATED", _NO_TOKEN, closing=True)
                        return
                    authenticated = True
                    send_frame(sock, pack_header(Kind.REPLY, Method.HELLO, 0, call=header.call), [])
                elif header.method == Method.HEALTH:
                    serving = b"NOT_SERVING" if self._stopping.is_set() else b"SERVING"
                    send_frame(sock, pack_header(Kind.REPLY, Method.HEALTH, len(serving), call=header.call), [serving])
                else:
                    self._call(sock, header, body, _TCPCall(sock, peer, header.deadline_ms, sink))
            finally:
                with self._lock:
                    if raw in self._connections:
                        self._connections[raw] = False
            sock.settimeout(None if authenticated else AUTH_TIMEOUT_S)  # an authenticated client may idle

    def _limit(self, method: Method, authenticated: bool) -> int:
        if not authenticated or method in (Method.HELLO, Method.HEALTH):
            return HELLO_MAX_BYTES
        return self.max_message_bytes if method in _TENSOR_METHODS else SMALL_MESSAGE_BYTES

    def _call(self, sock: socket.socket, header, body, call: _TCPCall) -> None:
        """Run one call on the driver and write its reply (or the refusal as an ERROR frame), then tell the driver."""
        try:
            self._answer(sock, header, body, call)
        finally:
            self.driver.after_reply()  # the events of this call, written once its reply is out

    def _answer(self, sock: socket.socket, header, body, call: _TCPCall) -> None:
        method = header.method
        try:
            reply = self._dispatch(method, body, call)
        except Refused as refused:
            code = "DEADLINE_EXCEEDED" if refused.code == "CANCELLED" and call.expired() else refused.code
            with self._writing(call):
                send_error(sock, method, header.call, code, refused.message)
            return
        except Exception as exc:  # a bug: the client gets one line, the log the traceback
            logger.exception("tcp %s call from %s failed", method.name, call.peer)
            with self._writing(call):
                send_error(
                    sock,
                    method,
                    header.call,
                    "INTERNAL",
                    f"the server failed handling {method.name}: {type(exc).__name__}: {exc}".splitlines()[0],
                )
            return
        pieces = encode(reply)
        try:
            with self._writing(call), tracing.span("send", bytes=len(pieces)):
                send_frame(sock, pack_header(Kind.REPLY, method, len(pieces), call=header.call), pieces.buffers)
        finally:
            pieces.release()  # the lease on the version's tensors the reply was sent from

    @contextmanager
    def _writing(self, call: _TCPCall):
        """Write a reply on ``call``'s connection: after its provisional slices, never between two frames."""
        sink = call.sink
        if sink is None:
            yield
            return
        self.driver.sent_provisional(sink.flush())
        with sink.write_lock:
            yield

    def _dispatch(self, method: Method, body, call: _TCPCall) -> Any:
        driver = self.driver
        if method == Method.PUSH:
            return driver.handle_push(body, call)
        if method == Method.INITIALIZE:
            return driver.handle_initialize(body)
        if method == Method.STATUS:
            return driver.handle_status()
        request_type = _REQUESTS[method]
        try:
            request = request_type.FromString(body)
        except Exception as exc:  # protobuf's DecodeError
            raise Refused("INVALID_ARGUMENT", f"{method.name.lower()}: malformed message: {exc}") from None
        if method == Method.REGISTER:
            return driver.handle_register(request, call.peer)
        if method == Method.PULL:
            return driver.handle_pull(request, call)
        if method == Method.HEARTBEAT:
            return driver.handle_heartbeat(request)
        return driver.handle_finish(request)


_REQUESTS = {
    Method.REGISTER: pb.RegisterRequest,
    Method.PULL: pb.PullRequest,
    Method.HEARTBEAT: pb.HeartbeatRequest,
    Method.FINISH: pb.FinishRequest,
}
_NO_TOKEN = (
    "missing or wrong auth token (the connection's first frame must be a HELLO carrying system.auth_token "
    "or $DTS_AUTH_TOKEN)"
)


def _echoed(header_buffer: bytearray) -> tuple[Method, int]:
    """The method and call number of a refused header, for its ERROR frame (so the caller matches the
    refusal to its call); HELLO when the method byte names none."""
    try:
        method = Method(header_buffer[5])
    except ValueError:
        method = Method.HELLO
    return method, int.from_bytes(header_buffer[8:12], "little")


def _server_tls_context(system: SystemConfig) -> ssl.SSLContext | None:
    """The server's TLS context from ``tls_cert_file`` + ``tls_key_file``, or ``None`` (plaintext).

    Raises:
        SetupError: only one file is set, one cannot be read, or they are not a certificate and its key.
    """
    if server_tls_files(system) is None:  # checks both-or-neither and that the files are readable
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(system.tls_cert_file, system.tls_key_file)
    except ssl.SSLError as exc:
        raise SetupError(f"system.tls_cert_file / system.tls_key_file: not a certificate and its key ({exc})") from None
    return context
