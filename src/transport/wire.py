"""Message bytes of the parameter-server protocol, shared by every transport and the virtual clock.

The protocol's messages are protobuf messages (``protos/parameter_server.proto``) whose large
``repeated bytes`` fields (parameters, gradients, buffers) hold tensors. Protobuf's own
``SerializeToString`` of a message holding tens of MB costs about a millisecond per MB here (a
growing buffer, then a copy into ``bytes``), several times what the transport needs to send it, so
the large fields are encoded and decoded here instead: :func:`serialize` joins the small fields
(serialized by protobuf) with the tensors' bytes in one copy, and :func:`split` hands the large
fields back as zero-copy views of the received message. The result is exactly the protobuf wire
format, so any protobuf parser reads it.

Tensors travel as little-endian float32 bytes (:func:`tensor_view`, :func:`copy_bytes_into`),
gradients as the compression library's payloads. :func:`encode` hands the same bytes back unjoined
(:class:`Pieces`: the tensors' own memory, for a transport that sends a list of buffers). Nothing
here knows about gRPC or sockets: the gRPC service (:mod:`src.transport.grpc`), the TCP transport
(:mod:`src.transport.tcp`) and the virtual-time driver (:mod:`src.virtual.run`) move the same
message bytes, so their byte counts differ only by each transport's own framing.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

_FLOAT32_LE = np.dtype("<f4")

# ----------------------------------------------------------------------------- tensors <-> bytes


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's values as little-endian float32 bytes: a view, no copy, for a contiguous CPU float32 tensor."""
    array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
    return memoryview(array.astype(_FLOAT32_LE, copy=False)).cast("B")


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian float32 bytes of ``tensor`` (one copy)."""
    return tensor_view(tensor).tobytes()


def check_float32_bytes(data, numel: int, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``data`` holds exactly ``numel`` float32 values."""
    if len(data) != 4 * numel:
        raise ValueError(f"{what}: {len(data)} bytes, expected {4 * numel} ({numel} float32 values)")


def copy_bytes_into(tensor: torch.Tensor, data, what: str = "tensor") -> None:
    """Overwrite ``tensor`` (float32) in place with the float32 values in ``data`` (bytes or a view).

    Raises:
        ValueError: ``data`` does not hold exactly ``tensor.numel()`` float32 values.
    """
    check_float32_bytes(data, tensor.numel(), what)
    source = np.frombuffer(data, dtype=_FLOAT32_LE)
    with torch.no_grad():
        if tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype == torch.float32:
            np.copyto(tensor.numpy().reshape(-1), source)  # straight from the message, no temporary
        else:
            tensor.copy_(torch.from_numpy(source.astype(np.float32)).view_as(tensor))


# ----------------------------------------------------------------------------- messages with large bytes fields


def field_number(message_type, name: str) -> int:
    return message_type.DESCRIPTOR.fields_by_name[name].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(view) or shift > 63:
            raise ValueError("malformed message: truncated or overlong varint")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


@dataclass
class Outgoing:
    """A message to send plus its large ``repeated bytes`` fields, kept out of protobuf: ``{field name: chunks}``.

    A chunk is one field value: a buffer, a :class:`SharedRef`, or a tuple of buffers that are its bytes in
    order (a payload in parts, e.g. :meth:`src.compression.IdentityCompressor.parts`: a header and a view of
    a tensor's memory, sent without joining them)."""

    message: Any
    large: Mapping[str, Sequence[Any]] = field(default_factory=dict)


COALESCE_BYTES = 16 << 10
"""Pieces smaller than this are copied together into one (field tags, lengths, small tensors): a list of a
few large views and few small pieces is what a gather write (``sendmsg``) and a TLS record layer handle well."""


class SharedBuffers:
    """Byte views that messages are sent from while their owner may still change the memory behind them.

    The parameters of a version: replies are sent from the tensors themselves, and the next optimizer
    step writes them in place. A send in progress holds a lease (:meth:`acquire` / :meth:`release`)
    and reads the views with :attr:`lock` held, a chunk at a time (:meth:`view`); the owner calls
    :meth:`before_write` (holding nothing a sender waits for) before it writes. Then, with a lease
    held, the views are swapped for one copy of their bytes, so the sends go on with the same bytes;
    with none, the views are dropped without a copy (:attr:`valid` becomes ``False``). So a reply
    costs no copy unless the model changes while it is on the wire, and a slow receiver never holds
    the owner up longer than one chunk's write into the kernel.
    """

    def __init__(self, views: Sequence[memoryview]):
        self.lock = threading.Lock()
        self._views = list(views)
        self.leases = 0
        self.valid = True
        self.copied = False

    def ref(self, index: int) -> "SharedRef":
        return SharedRef(self, index, self._views[index].nbytes)

    def view(self, index: int) -> memoryview:
        """The bytes of view ``index`` now (the caller holds :attr:`lock` while it reads them)."""
        if not self.valid:
            raise RuntimeError("shared buffers read after they were released without a lease")
        return self._views[index]

    def acquire(self) -> bool:
        """Take a lease for one send; ``False`` when the views are gone (the model changed, no send holding them)."""
        with self.lock:
            if not self.valid:
                return False
            self.leases += 1
            return True

    def release(self) -> None:
        with self.lock:
            self.leases -= 1

    def before_write(self) -> None:
        """The owner is about to change the memory: copy it for the sends holding a lease, or drop it."""
        with self.lock:
            if self.leases > 0:
                copy = memoryview(b"".join(self._views))  # one allocation, one pass
                offsets = itertools.accumulate((v.nbytes for v in self._views), initial=0)
                starts = list(offsets)
                self._views = [copy[a:b] for a, b in zip(starts, starts[1:])]
                self.copied = True
            else:
                self._views = []
                self.valid = False


@dataclass(frozen=True)
class SharedRef:
    """A piece of a message that is one of a :class:`SharedBuffers`' views (read when it is sent)."""

    shared: SharedBuffers
    index: int
    nbytes: int


@dataclass(frozen=True)
class Pieces:
    """A message's wire bytes as buffers in order, not joined: views of tensors stay views.

    What :func:`encode` returns, for a transport that writes a list of buffers (``socket.sendmsg``)
    and so sends the tensors from their own memory. ``len()`` is the message's size in bytes, the
    same as ``len(serialize(...))`` of the same message. Pieces may be :class:`SharedRef`; ``shared``
    is then their :class:`SharedBuffers`, on which the builder took a lease that the sender releases
    (:meth:`release`) once the message is out.
    """

    buffers: tuple[Any, ...]
    nbytes: int
    shared: SharedBuffers | None = None

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        if self.shared is None:
            return b"".join(self.buffers)
        with self.shared.lock:
            return b"".join(self.shared.view(b.index) if isinstance(b, SharedRef) else b for b in self.buffers)

    def release(self) -> None:
        """The message is sent (or will not be): give back the lease on its shared buffers, if any."""
        if self.shared is not None:
            self.shared.release()


def encode(outgoing: "Outgoing | Pieces | Any") -> Pieces:
    """Protobuf wire bytes of ``outgoing`` as :class:`Pieces`: its message, then each large field's chunks,
    with the chunks' memory referenced, not copied (small pieces are joined, see :data:`COALESCE_BYTES`).

    Protobuf parsers merge fields in any order, so this is exactly what the message with those
    fields set would parse back to.
    """
    if isinstance(outgoing, Pieces):
        return outgoing
    if isinstance(outgoing, (bytes, bytearray, memoryview)):
        return Pieces((outgoing,), memoryview(outgoing).nbytes)
    if not isinstance(outgoing, Outgoing):
        data = outgoing.SerializeToString()
        return Pieces((data,), len(data))
    pieces: list[Any] = []
    shared = None
    small = bytearray(outgoing.message.SerializeToString())
    for name, chunks in outgoing.large.items():
        tag = _varint(field_number(type(outgoing.message), name) << 3 | 2)
        for chunk in chunks:
            if isinstance(chunk, SharedRef):  # read when sent: never copied in here
                small += tag + _varint(chunk.nbytes)
                pieces += [bytes(small), chunk]
                small, shared = bytearray(), chunk.shared
                continue
            views = [memoryview(part).cast("B") for part in (chunk if isinstance(chunk, tuple) else (chunk,))]
            small += tag + _varint(sum(len(view) for view in views))
            for view in views:
                if len(view) < COALESCE_BYTES:
                    small += view
                    continue
                pieces += [bytes(small), view]
                small = bytearray()
    if small or not pieces:
        pieces.append(bytes(small))
    nbytes = sum(piece.nbytes if isinstance(piece, SharedRef) else memoryview(piece).nbytes for piece in pieces)
    return Pieces(tuple(pieces), nbytes, shared)


def chunk_size(chunk: Any) -> int:
    """Bytes of one :class:`Outgoing` chunk's value (a buffer, a :class:`SharedRef`, a tuple of buffers)."""
    if isinstance(chunk, SharedRef):
        return chunk.nbytes
    if isinstance(chunk, tuple):
        return sum(memoryview(part).nbytes for part in chunk)
    return memoryview(chunk).nbytes


def serialize(outgoing: "Outgoing | Pieces | Any") -> bytes:
    """Protobuf wire bytes of ``outgoing`` (see :func:`encode`) joined into one ``bytes``: one copy of each chunk."""
    if isinstance(outgoing, bytes):
        return outgoing
    if isinstance(outgoing, Outgoing):
        return bytes(encode(outgoing))
    if isinstance(outgoing, Pieces):
        return bytes(outgoing)
    return outgoing.SerializeToString()


@dataclass
class Received:
    """A parsed message whose large ``repeated bytes`` fields are zero-copy views: ``large[field name]``.

    ``early``: what a receiver computed from large fields while the rest of the message was still
    arriving (:class:`MessageSplitter`'s ``on_large``), by ``(field name, index)``: each entry is
    ``(the field's view, result)``, the view the very object in ``large``.
    """

    message: Any
    large: dict[str, list[memoryview]]
    early: dict[tuple[str, int], tuple[memoryview, Any]] = field(default_factory=dict)


def split(data: bytes, message_type, large_fields: Sequence[str]) -> Received:
    """Parse ``data`` as ``message_type``, handing ``large_fields`` back as views of ``data``.

    Raises:
        ValueError: the bytes are not a well-formed message (truncated field, bad wire type).
    """
    return MessageSplitter(data, message_type, large_fields).finish()


class MessageSplitter:
    """:func:`split` done as a message's bytes arrive in ``data`` (a buffer of the whole message's size).

    :meth:`advance` walks the top-level fields lying wholly within the bytes arrived so far; each
    large field, once complete, goes to ``on_large(name, index, view)`` (while it is still in the
    cache the receive just wrote it through), whose result is kept in :attr:`Received.early`.
    While a large field is still arriving, each advance into it calls ``on_partial(name, index, view,
    arrived)``: ``view`` is the whole field's (its bytes from ``arrived`` on not in yet), so a receiver
    can work on the part that is in while the rest comes (those bytes are never written again).
    ``on_head(message)``, once: the small fields parsed as soon as the walk reaches the first large field
    (:func:`encode` writes every small field before the large ones), so a receiver can act on a reply's
    verdict while its tensors still arrive (a streamed push's reply, :mod:`src.transport.stream`); at
    :meth:`finish` when there is no large field.
    :meth:`finish` walks the rest with every byte there and parses the small fields. The walk is
    the same for any split of the arrivals, so the result is :func:`split`'s on the same bytes.
    """

    def __init__(
        self,
        data,
        message_type,
        large_fields: Sequence[str],
        on_large: Callable[[str, int, memoryview], Any] | None = None,
        on_partial: Callable[[str, int, memoryview, int], None] | None = None,
        on_head: Callable[[Any], None] | None = None,
    ):
        self.view = memoryview(data)
        self.on_head = on_head
        self.head: Any = None  # the small fields, once on_head has been given them
        self.message_type = message_type
        self.on_large = on_large
        self.on_partial = on_partial
        self._arriving: tuple[str, int, int, int] | None = None  # the large field awaited: name, index, start, length
        self._numbers = {field_number(message_type, name): name for name in large_fields}
        self._large: dict[str, list[memoryview]] = {name: [] for name in large_fields}
        self._small: list[memoryview] = []
        self._early: dict[tuple[str, int], tuple[memoryview, Any]] = {}
        self._position = 0
        self._wait_until = 0  # the field being walked ends here: nothing to do before it has arrived

    def advance(self, available: int, *, final: bool = False) -> None:
        """Walk the fields within the first ``available`` bytes; a field that cannot be walked yet waits.

        Raises:
            ValueError: ``final`` (every byte is in: what :meth:`finish` does) and the message is malformed.
        """
        if not final and available < self._wait_until:
            self._partial(available)
            return
        self._arriving = None
        view = self.view if available >= len(self.view) else self.view[:available]
        position = self._position
        while position < len(view):
            start = position
            try:
                key, position = _read_varint(view, position)
                wire_type = key & 7
                if wire_type == 0:
                    _, position = _read_varint(view, position)
                elif wire_type == 1:
                    position += 8
                elif wire_type == 5:
                    position += 4
                elif wire_type == 2:
                    length, position = _read_varint(view, position)
                    if key >> 3 in self._numbers:
                        if self.on_head is not None and self.head is None:
                            self._give_head()
                        name = self._numbers[key >> 3]
                        if position + length <= len(view):
                            self._take_large(name, position, length)
                            position += length
                            self._position = position
                            continue
                        if not final:
                            self._arriving = (name, len(self._large[name]), position, length)
                    position += length
                else:
                    raise ValueError(f"malformed message: unsupported wire type {wire_type}")
            except ValueError:
                if final:
                    raise
                return  # a varint runs past what has arrived (or worse: the last walk says which)
            if position > len(view):
                if final:
                    raise ValueError("malformed message: a field runs past the end")
                self._wait_until = position
                self._partial(available)
                return
            self._small.append(view[start:position])
            self._position = position

    def _partial(self, available: int) -> None:
        """Tell ``on_partial`` how much of the large field being awaited is in."""
        if self._arriving is not None and self.on_partial is not None:
            name, index, start, length = self._arriving
            if available > start:
                self.on_partial(name, index, self.view[start : start + length], available - start)

    def _take_large(self, name: str, position: int, length: int) -> None:
        chunk = self.view[position : position + length]
        chunks = self._large[name]
        chunks.append(chunk)
        if self.on_large is not None:
            self._early[(name, len(chunks) - 1)] = (chunk, self.on_large(name, len(chunks) - 1, chunk))

    def finish(self) -> Received:
        """Walk what is left and parse the small fields: the message.

        Raises:
            ValueError: the bytes are not a well-formed message (truncated field, bad wire type).
        """
        self.advance(len(self.view), final=True)
        message = self._parse_small()
        if self.on_head is not None and self.head is None:
            self.head = message
            self.on_head(message)
        return Received(message, self._large, self._early)

    def _parse_small(self) -> Any:
        try:
            return self.message_type.FromString(b"".join(self._small))
        except Exception as exc:  # protobuf's DecodeError
            raise ValueError(f"malformed message: {exc}") from None

    def _give_head(self) -> None:
        """The small fields walked so far, to ``on_head`` (a malformed head is left to :meth:`finish` to raise)."""
        try:
            self.head = self._parse_small()
        except ValueError:
            return
        self.on_head(self.head)
