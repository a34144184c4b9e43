"""A TCP connection's provisional slices (``system.pipelined_replies``): the frames :mod:`src.ps.state.slice_pipeline`
sends a worker during its push, written by a thread of their own.

A slice is stepped on whichever connection's thread brought the last worker's values of it, and goes to every
worker of the round. That thread must not wait on another connection's socket: if a worker's receive buffer is
full (it reads only once its own push is out), the thread would stop reading its own worker's push, whose worker
might be the one that must finish first. So :meth:`TCPSink.send` only queues, and one writer thread per connection
writes PROVISIONAL frames (:data:`~src.transport.stream.PROVISIONAL_HEAD`, then the values) in order. The
connection's own replies go out after every queued slice (:meth:`TCPSink.flush`) and under the same write lock, so
frames never interleave and a worker reads its slices before the reply that names them.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading

import torch

from src.transport.sinks import Sink
from src.transport.stream import PROVISIONAL_HEAD
from src.transport.tcp_frames import HEADER_BYTES, Kind, Method, pack_header, send_frame
from src.transport.wire import tensor_view

logger = logging.getLogger(__name__)
_STOP = object()


class TCPSink(Sink):
    """Provisional slices for the worker on one TCP connection (see the module docstring)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.write_lock = threading.Lock()
        """Held for each frame written on the connection (slices here, the connection's replies by its thread)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._sent_bytes = 0

    def send(self, version: int, index: int, start: int, values: torch.Tensor) -> None:
        if self.closed:
            return
        with self._idle:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="provisional-slices", daemon=True)
                self._thread.start()
        self._queue.put((version, index, start, values))

    def flush(self) -> int:
        """Wait until every queued slice is written (or the connection failed); returns the bytes written since the
        last flush (frames and all), for the server's count of what it sent."""
        with self._idle:
            while self._pending and not self.closed:
                self._idle.wait()
            sent, self._sent_bytes = self._sent_bytes, 0
        return sent

    def close(self) -> None:
        """The connection ended: what is queued is dropped, the writer stops."""
        self.closed = True
        self._queue.put(_STOP)
        with self._idle:
            self._idle.notify_all()

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            version, index, start, values = item
            head = PROVISIONAL_HEAD.pack(version, index, start)
            body = tensor_view(values)
            size = len(head) + len(body)
            try:
                if not self.closed:
                    with self.write_lock:
                        send_frame(self._sock, pack_header(Kind.REPLY, Method.PROVISIONAL, size), [head, body])
                    with self._idle:
                        self._sent_bytes += HEADER_BYTES + size
            except (OSError, ValueError):  # the connection broke: its thread ends it; the reply names none of these
                self.closed = True
            except Exception:  # a bug: no more slices on this connection (its replies carry every parameter)
                logger.exception("provisional slices: writing one failed")
                self.closed = True
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
