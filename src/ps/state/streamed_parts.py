"""A streamed push on the server's side (``system.streaming``): its parts collected as they arrive, each gradient
checked and decoded at once, then joined with the push's own message into the push the driver handles.

A streamed push (:mod:`src.transport.stream`) is one part per gradient, sent as backward produces it, then the
push's message with no gradients of its own. The transport hands each part to :meth:`PushParts.add` as it
arrives (the TCP server on the connection's thread, outside the core's lock, so the decode overlaps the rest of
the push still on the wire), and the message to :meth:`PushParts.assemble`. What that returns is handled by
:meth:`src.parameter_server.ParameterServer.handle_push` exactly as a push read in one piece: its
:meth:`AssembledPush.finish` is the same :class:`~src.transport.wire.Received` (the gradients in parameter
order, the early decodes kept), so the server's verdict and update do not depend on how the push travelled.

What is wrong with the parts (no index, a gradient twice or missing, no such parameter, too many bytes) is kept
and refuses the push, with its reason, once the push's message comes: the connection (TCP) or the server (gRPC's
``PushStream``, :mod:`src.transport.grpc_service`) stays usable and nothing is applied.
"""

from __future__ import annotations

from typing import Any, Callable

from src import parameter_server_pb2 as pb
from src.compressors.payload_format import HEADER_SIZE, dense_float32_numel
from src.ps.state.decoding import ModelLayout
from src.ps.state.slice_pipeline import ELEMENT_BYTES
from src.transport.stream import PART_INDEX, split_part
from src.transport.wire import MessageSplitter, Received, split


def push_size(data) -> int:
    """Bytes of a push as it arrived: one message, one read in pieces (a splitter), or a streamed push's parts and
    message."""
    if isinstance(data, AssembledPush):
        return data.nbytes
    return len(data.view) if isinstance(data, MessageSplitter) else len(data)


def arrived_push(data, large_fields) -> Received:
    """The push in ``data`` (as :func:`push_size` takes it), split.

    Raises:
        ValueError: the bytes are not a well-formed push (or a streamed push's parts are wrong).
    """
    if isinstance(data, (MessageSplitter, AssembledPush)):
        return data.finish()
    return split(data, pb.PushRequest, large_fields)


class PushParts:
    """The parts of one streamed push so far.

    Args:
        layout: the served model's layout (each part is checked and decoded against it as it arrives); ``None``
            (no model yet): kept as they are, and the push is refused with the rest later.
        large_fields: the push's large fields (:data:`~src.transport.grpc_service.PUSH_LARGE_FIELDS`).
        max_bytes: most bytes the parts together may hold (the transport's push size limit).
    """

    def __init__(
        self,
        layout: ModelLayout | None,
        large_fields,
        max_bytes: int,
        *,
        arriving: Callable[[int, memoryview, int], None] | None = None,
    ):
        self.layout = layout
        self.large_fields = large_fields
        self.max_bytes = max_bytes
        self.arriving = arriving
        self.nbytes = 0
        self.problem: str | None = None  # the first thing wrong with a part: the push's refusal
        self._payloads: dict[int, memoryview] = {}
        self._early: dict[tuple[str, int], tuple[memoryview, Any]] = {}
        self._reading: tuple[Any, int, memoryview] | None = None  # the part being read: (its body, index, values)

    def progress(self, body: memoryview, filled: int) -> None:
        """A transport that reads a part in pieces (TCP): ``filled`` bytes of ``body`` are in. With ``arriving``
        (``system.pipelined_replies``), a dense float32 gradient's values are reported as they come:
        ``arriving(index, values, how many are in)``. Nothing is checked here: :meth:`add` checks the whole part."""
        if self.arriving is None or self.problem is not None:
            return
        reading = self._reading
        if reading is None or reading[0] is not body:
            if filled < PART_INDEX.size + HEADER_SIZE:
                return
            index = PART_INDEX.unpack_from(body)[0]
            numel = dense_float32_numel(body[PART_INDEX.size :])
            expected = PART_INDEX.size + HEADER_SIZE + ELEMENT_BYTES * (numel or 0)
            if numel is None or len(body) != expected:
                self._reading = (body, -1, body)
                return
            self._reading = reading = (body, index, body[PART_INDEX.size + HEADER_SIZE :])
        if reading[1] >= 0:
            self.arriving(reading[1], reading[2], (filled - PART_INDEX.size - HEADER_SIZE) // ELEMENT_BYTES)

    def add(self, body) -> None:
        """A part arrived (its bytes: the tensor's index, then its payload): check and decode it."""
        self.nbytes += len(body)
        if self.problem is not None:
            return
        if self.nbytes > self.max_bytes:
            self._refuse(f"its parts exceed the push limit of {self.max_bytes} bytes")
            return
        try:
            index, payload = split_part(body)
        except ValueError as exc:
            self._refuse(str(exc))
            return
        if index in self._payloads:
            self._refuse(f"the part of gradient {index} arrived twice")
            return
        if self.layout is not None and index >= len(self.layout.param_shapes):
            self._refuse(f"a part of gradient {index}: the model has {len(self.layout.param_shapes)} parameters")
            return
        self._payloads[index] = payload
        if self.layout is not None:
            try:
                self._early[("gradients", index)] = (payload, self.layout.gradient(index, payload))
            except Exception:  # noqa: BLE001  (a bug: the whole push's decode does it again and answers INTERNAL)
                pass

    def _refuse(self, reason: str) -> None:
        self.problem = reason
        self._payloads.clear()
        self._early.clear()

    def assemble(self, body) -> AssembledPush:
        """The push, once its own message (``body``: its bytes, without gradients) is in."""
        return AssembledPush(self, body)


class AssembledPush:
    """A streamed push's parts and message, as :meth:`~src.parameter_server.ParameterServer.handle_push` takes a push
    that arrived in pieces (:meth:`finish`, :attr:`nbytes`)."""

    def __init__(self, parts: PushParts, body):
        self.parts = parts
        self.body = body
        self.nbytes = parts.nbytes + len(body)

    def finish(self) -> Received:
        """The push as one message would have given it: gradients in parameter order.

        Raises:
            ValueError: a part was wrong, a gradient's part is missing, or the message carries gradients itself.
        """
        parts = self.parts
        if parts.problem is not None:
            raise ValueError(f"streamed push: {parts.problem}")
        received = split(self.body, pb.PushRequest, parts.large_fields)
        if received.large["gradients"]:
            raise ValueError("a streamed push carries its gradients in parts, not in its message")
        payloads = parts._payloads
        # one part per parameter (the model's, once it has one; none at all: a skipped step's push)
        count = len(parts.layout.param_shapes) if parts.layout is not None and payloads else len(payloads)
        missing = next((i for i in range(count) if i not in payloads), None)
        if missing is not None:
            raise ValueError(
                f"streamed push: the part of gradient {missing} is missing (parts of gradients "
                f"{sorted(payloads)[:8]}{'...' if len(payloads) > 8 else ''} arrived)"
            )
        received.large["gradients"] = [payloads[i] for i in range(count)]
        received.early.update(parts._early)
        return received
