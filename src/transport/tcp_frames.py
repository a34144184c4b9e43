"""The frames of the parameter server's TCP transport: their layout, and reading and writing them on a socket.

Shared by the client (:mod:`src.transport.tcp`), the server (:mod:`src.transport.tcp_server`) and the health
probe (:mod:`src.transport.healthcheck`); it imports neither torch nor the server, so a probe stays light.

A frame is a fixed 20-byte header, then ``length`` bytes of body::

    offset  size  field
    0       4     magic     b"DTS1": this protocol, version 1
    4       1     kind      REQUEST, REPLY or ERROR
    5       1     method    HELLO, REGISTER, INITIALIZE, PULL, PUSH, HEARTBEAT, FINISH, STATUS, HEALTH, PUSH_PART
    6       1     status    an ERROR's status code (gRPC's numbers: 3 INVALID_ARGUMENT, 16 UNAUTHENTICATED, ...); else 0
    7       1     flags     CLOSING: the sender closes the connection after this frame;
                            STREAMED: a PUSH whose gradients came ahead of it as PUSH_PART frames
    8       4     call      the request's number; its REPLY or ERROR carries it back
    12      4     deadline  milliseconds the caller waits for the reply (0: no deadline); requests only
    16      4     length    body bytes

all little-endian. A request's or reply's body is the protobuf message exactly as the gRPC transport
carries it (:mod:`src.transport.wire`: the small fields by protobuf, the tensors as raw bytes fields), so both
transports move the same message bytes and differ by the 20-byte header; an ERROR's body is its
details in UTF-8; a HELLO's is the auth token; a HEALTH reply's is ``SERVING``.

A streamed push (``system.streaming``, :mod:`src.transport.stream`) is PUSH_PART requests, one per gradient as
backward produces it, each body a part (:func:`~src.transport.stream.part_pieces`: the tensor's index, then its
payload) and none answered, then the PUSH request with the STREAMED flag and no gradients of its own, all with
the push's call number; its one REPLY is read as it arrives.

Reading: the header goes into a fixed buffer and is checked (magic, kind, method, and the length
against the limit the reader sets for that method) *before* the body's buffer is allocated; the
body is then read with ``recv_into`` straight into one uninitialized buffer (no zero-fill, no
joining of chunks), whose views become the message's tensors. Writing: the header and the body's
pieces go out in one gather write (``sendmsg``), so tensors are sent from their own memory; a TLS
socket, which has no gather write, sends the pieces one by one.

Errors: a failed call raises :class:`~src.transport.errors.CallError` (``code``, ``message``), as the gRPC client's do,
so code written against the gRPC transport (retries, lost sessions, refusals) reads both the same.
"""

from __future__ import annotations

import enum
import os
import select
import socket
import ssl
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from src.transport.errors import STATUS_NAMES, CallError

MAGIC = b"DTS1"
HEADER = struct.Struct("<4sBBBBIII")
HEADER_BYTES = HEADER.size
CLOSING = 0x01
"""``flags`` bit: the sender closes the connection after this frame (a refused hello, an oversized frame)."""
STREAMED = 0x02
"""``flags`` bit of a PUSH: its gradients came ahead of it in PUSH_PART frames on the same connection."""
HELLO_MAX_BYTES = 4096
"""Largest HELLO (auth token) or HEALTH body: all a connection that has not authenticated may make the server read."""
MAX_IOV = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
"""Buffers per ``sendmsg`` call (the kernel's IOV_MAX)."""


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    ERROR = 3


class Method(enum.IntEnum):
    HELLO = 1
    REGISTER = 2
    INITIALIZE = 3
    PULL = 4
    PUSH = 5
    HEARTBEAT = 6
    FINISH = 7
    STATUS = 8
    HEALTH = 9
    PUSH_PART = 10
    PROVISIONAL = 11
    """Server to client, during a streamed push (``system.pipelined_replies``): a provisional slice of a parameter
    (:data:`src.transport.stream.PROVISIONAL_HEAD`, then its float32 values); the push's reply says which stand."""


class FrameError(Exception):
    """A frame that breaks the protocol (bad magic, unknown kind or method, over its limit): the
    reader answers with ``status`` and closes the connection, since it cannot find the next frame."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class PeerClosed(ConnectionError):
    """The other end closed the connection (cleanly, or mid-frame)."""


@dataclass(frozen=True)
class Header:
    kind: Kind
    method: Method
    status: int
    flags: int
    call: int
    deadline_ms: int
    length: int

    @property
    def closing(self) -> bool:
        return bool(self.flags & CLOSING)

    @property
    def streamed(self) -> bool:
        return bool(self.flags & STREAMED)


def pack_header(
    kind: Kind,
    method: Method,
    length: int,
    *,
    call: int = 0,
    status: str | None = None,
    deadline_ms: int = 0,
    closing: bool = False,
    streamed: bool = False,
) -> bytes:
    return HEADER.pack(
        MAGIC,
        kind,
        method,
        STATUS_NAMES.index(status) if status is not None else 0,
        (CLOSING if closing else 0) | (STREAMED if streamed else 0),
        call & 0xFFFFFFFF,
        min(max(deadline_ms, 0), 0xFFFFFFFF),
        length,
    )


def parse_header(data) -> Header:
    """Check and unpack a frame header (see the module docstring).

    Raises:
        FrameError: not this protocol, or an unknown kind or method.
    """
    magic, kind, method, status, flags, call, deadline_ms, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(
            "INVALID_ARGUMENT",
            f"not a frame of this protocol: magic {bytes(magic)!r}, expected {MAGIC!r} "
            f"(a client of another transport? system.transport must match on both ends)",
        )
    try:
        return Header(Kind(kind), Method(method), status, flags, call, deadline_ms, length)
    except ValueError:
        what = f"kind {kind}" if kind not in Kind._value2member_map_ else f"method {method}"
        raise FrameError("INVALID_ARGUMENT", f"frame of unknown {what}") from None


RECEIVE_CHUNK_BYTES = 32 << 10
"""Most bytes one read takes from the socket, unless the reader says otherwise. A read holds the socket while it
copies; on loopback here, reads of whatever is left of a message (several MB at once) made the kernel retransmit
segments and stall the sender: a raw echo of 16 MB each way took 12.9 ms so and 6.8 ms in 32 KB reads (43 MB: 39 ->
22.5 ms; 1 MB: the same). The client reads so, as do a pipelined push's parts (their reads are what the server
reports as arrived, and virtual time cuts its pieces at this size), and ``scripts/bench_ps.py``'s raw echo, the
wire's limit it is measured against, reads the same way."""

PUSH_READ_BYTES = 4 << 20
"""Most bytes one of the server's reads of a push takes (a whole push, or a streamed push's part that reports no
progress). A server reads several workers' pushes at once on few cores, and there fewer, larger reads pay: a 2-worker
sync run of wide_mlp (23 MB pushes) on 2 cores ran at 853-864 samples/s with the server's push reads at 4 MB against
779-812 at 32 KB (3 runs each, in turns; the workers' reads at 4 MB gained nothing: 748-794). One worker's round
trip alone (``scripts/bench_ps.py``) stayed within its noise: 1.7 / 4.7 / 18.9 / 47.5 ms at 1 / 4 / 16 / 43 MB,
against 1.8 / 6.3 / 18.5 / 43.1. 4 MB is the socket's receive buffer (``SOCKET_BUFFER_BYTES``), all one read can
find waiting."""


def receive_exactly(
    sock: socket.socket,
    view: memoryview,
    progress: Callable[[int], None] | None = None,
    *,
    read_bytes: int = RECEIVE_CHUNK_BYTES,
) -> None:
    """Fill ``view`` from ``sock`` in reads of at most ``read_bytes``; ``progress(bytes filled so far)`` after each
    read, if given.

    Raises:
        PeerClosed: the connection ended first.
        socket.timeout: no byte arrived within the socket's timeout.
    """
    filled, size = 0, len(view)
    while filled < size:
        count = sock.recv_into(view[filled:], min(size - filled, read_bytes))
        if count == 0:
            raise PeerClosed(f"connection closed after {filled} of {size} bytes" if filled else "connection closed")
        filled += count
        if progress is not None:
            progress(filled)


def receive_header(sock: socket.socket, into: bytearray) -> Header:
    """Read and check one frame header into the reader's fixed ``into`` buffer (:data:`HEADER_BYTES` long)."""
    receive_exactly(sock, memoryview(into))
    return parse_header(into)


def receive_body(sock: socket.socket, length: int) -> memoryview:
    """Read a body of ``length`` bytes (its limit already checked) into a new, uninitialized buffer."""
    view = new_body(length)
    receive_exactly(sock, view)
    return view


def new_body(length: int) -> memoryview:
    """An uninitialized buffer for a body of ``length`` bytes (its limit already checked)."""
    return memoryview(np.empty(length, dtype=np.uint8))  # no zero-fill: every byte is about to be written


def send_frame(sock: socket.socket, header: bytes, pieces: Sequence[Any]) -> None:
    """Write ``header`` then ``pieces`` (buffers, sent from their own memory) as one frame.

    Pieces that are :class:`~src.transport.wire.SharedRef` (the parameters of a version, which the server may
    change while they are on the wire) are read with their :class:`~src.transport.wire.SharedBuffers`' lock held,
    one non-blocking write at a time: the lock is never held while waiting for the peer.
    """
    items = [memoryview(header)] + [piece if _is_shared(piece) else memoryview(piece).cast("B") for piece in pieces]
    items = [item for item in items if item.nbytes]
    shared = next((item.shared for item in items if _is_shared(item)), None)
    if shared is not None:
        _send_shared(sock, items, shared)
        return
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS: the record layer copies each piece anyway
        for view in items:
            sock.sendall(view)
        return
    first = 0
    while first < len(items):
        sent = sock.sendmsg(items[first : first + MAX_IOV])
        first = _advance(items, first, sent)


TLS_CHUNK_BYTES = 1 << 20
"""Over TLS a shared piece is copied out a chunk at a time under its lock and written outside it."""


def _is_shared(item) -> bool:
    return hasattr(item, "shared") and hasattr(
        item, "index"
    )  # a src.transport.wire.SharedRef (this module imports no torch)


def _advance(items: list, first: int, sent: int) -> int:
    """Drop what went out whole from ``items[first:]``, trim the partly sent one; returns the new first index."""
    while first < len(items) and sent >= items[first].nbytes:
        sent -= items[first].nbytes
        first += 1
    if sent:
        item = items[first]
        if isinstance(item, _Rest):
            items[first] = _Rest(item.piece, item.skip + sent)
        elif _is_shared(item):
            items[first] = _Rest(item, sent)
        else:
            items[first] = item[sent:]
    return first


@dataclass(frozen=True)
class _Rest:
    """What is left of a shared piece after ``skip`` of its bytes went out."""

    piece: Any
    skip: int

    @property
    def nbytes(self) -> int:
        return self.piece.nbytes - self.skip


def _resolve(item) -> memoryview:
    """The bytes of a piece (a shared one's now: the caller holds its lock)."""
    if isinstance(item, _Rest):
        return item.piece.shared.view(item.piece.index)[item.skip :]
    return item.shared.view(item.index) if _is_shared(item) else item


def _send_shared(sock: socket.socket, items: list, shared) -> None:
    timeout = sock.gettimeout()
    tls = isinstance(sock, ssl.SSLSocket)
    first = 0
    if not tls:
        sock.settimeout(0.0)  # writes below never block (the lock is held); waiting is done outside it
    try:
        while first < len(items):
            if tls:
                with shared.lock:  # copy one chunk out, write it outside the lock
                    chunk = bytes(_resolve(items[first])[:TLS_CHUNK_BYTES])
                sock.sendall(chunk)
                first = _advance(items, first, len(chunk))
                continue
            _, writable, _ = select.select([], [sock], [], timeout)
            if not writable:
                raise socket.timeout("the peer read nothing within the timeout")
            with shared.lock:
                try:
                    sent = sock.sendmsg([_resolve(item) for item in items[first : first + MAX_IOV]])
                except BlockingIOError:
                    sent = 0
            first = _advance(items, first, sent)
    finally:
        if not tls:
            sock.settimeout(timeout)


def send_error(
    sock: socket.socket, method: Method, call: int, status: str, details: str, *, closing: bool = False
) -> int:
    """Write an ERROR frame; returns its size."""
    body = details.encode("utf-8", "replace")
    send_frame(sock, pack_header(Kind.ERROR, method, len(body), call=call, status=status, closing=closing), [body])
    return HEADER_BYTES + len(body)


def error_of(header: Header, body) -> CallError:
    """The :class:`CallError` an ERROR frame carries."""
    code = STATUS_NAMES[header.status] if header.status < len(STATUS_NAMES) else "UNKNOWN"
    return CallError(code, bytes(body).decode("utf-8", "replace"))


def peer_name(address: tuple) -> str:
    """``ipv4:10.0.0.2:51234`` / ``ipv6:[::1]:51234``: how gRPC names a peer, so events read the same."""
    host, port = address[0], address[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def health_check(
    host: str, port: int, *, timeout_s: float, context: ssl.SSLContext | None = None, server_name: str | None = None
) -> str:
    """Ask a TCP-transport server whether it serves (no auth token needed); returns ``SERVING``.

    Raises:
        CallError: the server did not answer (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``) or refused.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            sock = context.wrap_socket(raw, server_hostname=server_name or host) if context is not None else raw
            with sock:
                send_frame(sock, pack_header(Kind.REQUEST, Method.HEALTH, 0, call=1), [])
                header = receive_header(sock, bytearray(HEADER_BYTES))
                if header.length > HELLO_MAX_BYTES:
                    raise CallError("INTERNAL", f"health reply of {header.length} bytes")
                body = receive_body(sock, header.length)
    except socket.timeout:
        raise CallError("DEADLINE_EXCEEDED", f"no answer within {timeout_s:g} s") from None
    except FrameError as exc:
        raise CallError("UNAVAILABLE", exc.message) from None
    except OSError as exc:
        raise CallError("UNAVAILABLE", f"cannot reach {host}:{port}: {exc}") from None
    if header.kind == Kind.ERROR:
        raise error_of(header, body)
    return bytes(body).decode("ascii", "replace")
