"""A gRPC ``PushStream`` call's provisional slices (``system.pipelined_replies``): the messages
:mod:`src.ps.state.slice_pipeline` sends a worker during its push, queued for the call's response stream, then the
call's own end.

gRPC has no connection a server can write to: a call answers by what its handler yields, on the handler's thread.
So the handler (:meth:`src.transport.grpc_service.GrpcMethods.PushStream`) reads the push and waits at the barrier on a
thread of its own, and yields what comes out of :meth:`GrpcSink.messages`: each slice as it is queued (one
``PushStreamReply`` whose ``provisional`` is the slice: :func:`~src.transport.grpc.provisional_message`), then, once
the push is handled (:meth:`GrpcSink.end`), the reply or the call's error. One queue, in order: the reply comes after
every slice queued before it, so a worker has the slices its reply names as provisional before the reply.

A sink is one call's: a slice queued on it is on that call's stream or nowhere, so the pipeline's count of what
went on a sink (:meth:`SlicePipeline.omitted <src.ps.state.slice_pipeline.SlicePipeline.omitted>`) is what that call's
client received. :meth:`GrpcSink.send` only queues (the thread that steps a slice brings another worker's push in
and must not wait on this call); the values become a message on the handler's thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

import torch

from src.transport.grpc import provisional_message
from src.transport.sinks import Sink
from src.transport.wire import Pieces

_END = object()


class GrpcSink(Sink):
    """Provisional slices for one ``PushStream`` call, then its end (see the module docstring)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._gone = False  # the handler stopped taking messages (the call ended early)
        self._sent_bytes = 0

    def send(self, version: int, index: int, start: int, values: torch.Tensor) -> None:
        if not self.closed:
            self._queue.put((version, index, start, values))

    def end(self, reply: Any = None, error: BaseException | None = None) -> None:
        """The push was handled (``reply``) or failed (``error``): no slice after this; :meth:`messages` ends with it.
        A reply whose call has ended already is released here (its lease on the parameters)."""
        with self._lock:
            self.closed = True
            if not self._gone:
                self._queue.put((_END, reply, error))
                return
        _release(reply)

    def messages(self) -> Iterator[bytes]:
        """Each queued slice's ``PushStreamReply`` message, until the call's end; returns its reply.

        Raises:
            BaseException: what the push's handling raised (:meth:`end`'s ``error``).
        """
        while True:
            item = self._queue.get()
            if item[0] is _END:
                _, reply, error = item
                if error is not None:
                    raise error
                return reply
            message = provisional_message(*item)
            with self._lock:
                self._sent_bytes += len(message)
            yield message

    def take_sent(self) -> int:
        """Bytes of the slices' messages handed to gRPC since the last call, for the server's count of what it sent."""
        with self._lock:
            sent, self._sent_bytes = self._sent_bytes, 0
        return sent

    def close(self) -> None:
        """The call ended: what is still queued is dropped (a reply among it released), nothing more is taken."""
        with self._lock:
            self.closed = True
            self._gone = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item[0] is _END:
                _release(item[1])


def _release(reply: Any) -> None:
    if isinstance(reply, Pieces):
        reply.release()
