"""The server's downlink replies: the parameters a Pull or Push reply carries, and a retried push's reply.

A reply is ``bytes`` joined under the core's lock, or (``reply_views``, the real servers)
:class:`~src.transport.wire.Pieces` over the parameters' own memory that the transport sends or joins outside
the lock, copied only if the next step comes while a reply is still being sent
(:class:`~src.transport.wire.SharedBuffers`). What a push's reply is kept as for a retry is decided here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from src import parameter_server_pb2 as pb
from src.ps.state.aggregation import ModelState
from src.ps.state.downlink import Downlink
from src.transport.wire import Outgoing, Pieces, SharedBuffers, encode, serialize, tensor_view


@dataclass
class StoredReply:
    """A push's reply kept for retries when replies are views (``reply_views``): its pieces and its message."""

    pieces: Pieces
    message: Any


class Replies:
    """Serializes replies with the current parameters of ``state`` (dense, or ``downlink``'s deltas)."""

    def __init__(self, state: ModelState, downlink: Downlink, *, views: bool):
        self.state = state
        self.downlink = downlink
        self.views = views
        # Byte views of what workers are sent, made once: the tensors are updated in place.
        self._param_views = [tensor_view(p) for p in state.sent()]
        self._buffer_views = [tensor_view(b) for b in state.buffers]
        self.shared: SharedBuffers | None = None  # views: the current version's tensors, once a reply used them
        if views:
            state.before_change = self._release_shared

    def serialize(self, message, worker: int, omit: list[int] = ()) -> bytes | Pieces:
        """``message`` with the current parameters (dense, or a delta for ``worker``) and buffers, serialized
        (``views``: as pieces over the tensors themselves, with a lease the sender gives back); the parameters in
        ``omit`` left empty (dense only: the worker holds them)."""
        self.state.sent()  # the lookahead point of this version, when workers are sent one
        downlink = self.downlink.encode(worker, self.state.version)
        if self.views:
            shared = self._shared_views()
            params = [shared.ref(i) for i in range(len(self._param_views))]
            buffers = [shared.ref(len(params) + i) for i in range(len(self._buffer_views))]
        else:
            params, buffers = list(self._param_views), self._buffer_views
        for index in omit:
            params[index] = b""
        tensors = {"parameters": params} if downlink.dense else {"parameter_deltas": downlink.payloads}
        # buffers first, then the parameters in model order: forward order, so a worker that streams
        # (system.streaming) starts its next forward on the first layers while the later ones arrive
        outgoing = Outgoing(message, {"buffers": buffers, **tensors})
        if not self.views:
            return serialize(outgoing)
        shared.acquire()  # valid: it is the current version's (the lock is held)
        return encode(outgoing)

    def kept_for_retry(self, reply: bytes | Pieces, verdict: pb.PushReply) -> Any:
        """What a push's ``reply`` is remembered as, for a retry of it."""
        # Views are kept with their verdict (rebuilt if the model moved on); bytes of a delta reply only as they
        # were (the worker's copy follows the deltas it got); a dense one is rebuilt from the verdict, so a
        # model-sized reply is not kept per worker.
        if self.views:
            return StoredReply(reply, verdict)
        return reply if self.downlink.compressor is not None else verdict

    def stored(self, worker: int, remembered: StoredReply, control: pb.Control) -> Pieces:
        """A retried push's reply again (with a lease); rebuilt when the model changed since and no send kept
        the first one's bytes."""
        reply = remembered.pieces
        if reply.shared is None or reply.shared.acquire():
            return reply
        remembered.pieces = self.rebuilt(worker, remembered.message, control)
        return remembered.pieces

    def rebuilt(self, worker: int, verdict: pb.PushReply, control: pb.Control) -> bytes | Pieces:
        """A handled push's verdict and work as answered, with this version's parameters, dense; nothing applied."""
        message = pb.PushReply()
        message.CopyFrom(verdict)
        message.version = self.state.version
        message.control.CopyFrom(control)
        self.downlink.forget(worker)  # dense: what the worker holds is unknown
        return self.serialize(message, worker)

    def _shared_views(self) -> SharedBuffers:
        """The current version's tensors as :class:`~src.transport.wire.SharedBuffers` (made at its first reply)."""
        if self.shared is None:
            self.shared = SharedBuffers(self._param_views + self._buffer_views)
        return self.shared

    def _release_shared(self) -> None:
        """The model is about to change: replies still being sent from it get a copy, the rest drop it."""
        if self.shared is not None:
            self.shared.before_write()
            self.shared = None
