"""A simulated worker connection's provisional slices (``system.pipelined_replies`` in virtual time).

The real server's connection writes :mod:`src.ps.state.slice_pipeline`'s slices to its worker as PROVISIONAL frames, in
order, and the connection's reply after the last of them (:class:`~src.transport.tcp_sink.TCPSink`). Here each slice is
a message of its serialized size (:data:`~src.transport.stream.PROVISIONAL_HEAD`, then the values) that crosses the
server's NIC and the worker's downlink, one after another on :attr:`VirtualSink.downlink`, and the reply of the worker's
push is put on the same line after them (:meth:`VirtualServer._reply <src.virtual.server.VirtualServer._reply>`): a
worker hears of its slices before the reply that names them, as on a real connection. A slice's step costs no virtual
seconds of the server's CPU (the real server computes it on the connection's thread while the barrier waits; its CPU is
not the server's lock).
"""

from __future__ import annotations

from typing import Callable

import torch

from src.emulation.overlap import FifoLink
from src.transport.sinks import Sink
from src.transport.stream import PROVISIONAL_HEAD
from src.transport.wire import tensor_view


class VirtualSink(Sink):
    """Provisional slices for one worker process's connection to a simulated server (see the module docstring).

    Args:
        down: sends a message's bytes down to the worker (:meth:`ServerWire.provisional
            <src.virtual.server.ServerWire.provisional>`), calling its second argument once they have left the link.
        process: the worker's process the connection belongs to.
    """

    def __init__(self, down: Callable[[bytes, Callable[[], None]], None], process: int):
        self.down = down
        self.process = process
        self.downlink = FifoLink()
        """The connection's messages to the worker, in order: slices, then the reply of the push."""

    def send(self, version: int, index: int, start: int, values: torch.Tensor) -> None:
        if self.closed:
            return
        body = PROVISIONAL_HEAD.pack(version, index, start) + bytes(tensor_view(values))
        self.downlink.put(lambda free: self.down(body, free))

    def then(self, start: Callable[[Callable[[], None]], None]) -> None:
        """Put a message (a :class:`~src.emulation.overlap.FifoLink` start) on the line after the queued slices."""
        self.downlink.put(start)
