"""Byte accounting of DDP's gradient exchange: what one rank sent and received, measured or estimated.

The comm hooks (:mod:`src.ddp.comm_hooks`) count the tensors and payloads they hand to the backend;
the backend's own allreduce cannot be seen, so it is counted as the ring-equivalent ``2(N-1)/N`` of
the gradient bytes (:func:`ring_allreduce_bytes`). :func:`bytes_accounting` names which of the two
a total is made of.
"""

from dataclasses import dataclass

from torch import nn


def ring_allreduce_bytes(world_size: int, tensor_bytes: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``tensor_bytes``: ``2(N-1)/N`` of it."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * tensor_bytes // world_size


@dataclass
class CommStats:
    """Bytes one rank sent and received, split into measured and estimated.

    ``bytes_sent`` / ``bytes_received`` are counted from the tensors and payloads our hooks hand to
    the backend. ``estimated_bytes_*`` stand for collectives whose wire traffic we cannot see (the
    backend's own allreduce): the ring-equivalent ``2(N-1)/N`` of the tensor size.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    estimated_bytes_sent: int = 0
    estimated_bytes_received: int = 0
    hook_seconds: float = 0.0
    """Wall time of the hooks' exchanges (compress, send, receive, decompress), overlapping the
    backward pass when the hook overlaps; 0 for the built-in allreduce."""
    dense_bytes: int = 0
    """Gradient bytes (float32) this rank handed to a compressing exchange."""
    payload_bytes: int = 0
    """What those gradients weighed on the way out: one copy of this rank's payloads (before the
    ``N-1``-fold fan-out of ``all_gather``); dense during warm-up. ``dense / payload`` is the
    compression ratio."""

    def measured(self, sent: int, received: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def compressed(self, dense: int, payload: int) -> None:
        self.dense_bytes += int(dense)
        self.payload_bytes += int(payload)

    def estimated(self, sent: int, received: int) -> None:
        self.estimated_bytes_sent += int(sent)
        self.estimated_bytes_received += int(received)

    @property
    def total_sent(self) -> int:
        return self.bytes_sent + self.estimated_bytes_sent

    @property
    def total_received(self) -> int:
        return self.bytes_received + self.estimated_bytes_received

    def accounting(self) -> str:
        """How :attr:`total_sent` was obtained; see :func:`bytes_accounting`."""
        return bytes_accounting(self.bytes_sent, self.estimated_bytes_sent)


def bytes_accounting(measured: float, estimated: float) -> str:
    """``measured``, ``estimated``, ``mixed`` (e.g. estimated warm-up + measured payloads) or ``none``."""
    return {(True, False): "measured", (False, True): "estimated", (True, True): "mixed"}.get(
        (measured > 0, estimated > 0), "none"
    )


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of all gradients DDP reduces each step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
