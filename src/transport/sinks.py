"""Where a server's provisional slices go (``system.pipelined_replies``): :class:`Sink`, one per worker connection.

The server's slice pipeline (:mod:`src.ps.state.slice_pipeline`) steps each slice of a sync round as soon as every
worker's values of it are in and sends it down on every connection's sink; each transport subclasses it
(:mod:`src.transport.grpc_sink`, :mod:`src.transport.tcp_sink`; virtual time's :mod:`src.virtual.sink`).
"""

from __future__ import annotations

import torch


class Sink:
    """Where provisional slices for one worker's connection go (the transport subclasses it: :meth:`send`)."""

    worker: int | None = None
    """The worker whose pushes come on this connection (set by :meth:`SlicePipeline.attach`)."""
    closed: bool = False

    def send(self, version: int, index: int, start: int, values: torch.Tensor) -> None:
        """Queue a provisional slice: parameter ``index``'s elements from ``start``, after the step of version
        ``version``'s round (never blocks the caller)."""
        raise NotImplementedError


__all__ = ["Sink"]
