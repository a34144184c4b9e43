"""The downlink: what a push reply carries back to a worker, dense parameters or a compressed delta.

With ``system.downlink_compression`` off, every reply carries the parameters (little-endian float32,
bit-identical to the server's). With ``topk`` or ``quantization``, the server keeps, per worker, a
*replica* of the parameters that worker holds; a reply carries ``compress(params - replica)`` per
parameter, and both ends add ``decompress(payload)`` to their copy (the same float32 additions, so
the worker's parameters equal the server's replica bit for bit). What a reply leaves out stays in
``params - replica`` and goes out with a later reply: error feedback kept on the server, so the
worker's copy trails the server by a bounded amount and never drifts away.

A reply is dense instead (a *refresh*) when the worker has no replica yet (a new incarnation), every
``downlink_refresh_interval`` versions since its last refresh, and whenever the delta would leave
the worker's copy more than ``downlink_drift_bound`` away from the parameters
(``||params - replica|| / ||params||``, after the delta).

Workers whose replicas went through the same replies (every worker of a sync run) share one
replica and one encoding per version: the cost is per distinct history, not per worker.
Quantization draws its stochastic rounding from a generator seeded by that history, so the
encoding is a pure function of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from src.compression import Compressor, build_compressor, decompress


@dataclass
class _Replica:
    """Parameters as a group of workers hold them, and the replies that made them so."""

    tensors: list[torch.Tensor]
    refreshed_at: int
    history: tuple[int, ...] = ()
    """Versions of the delta replies since the refresh (identifies the replica)."""


@dataclass
class DownlinkReply:
    """One reply's parameters: ``dense`` (views of the server's tensors) or ``deltas`` (payloads)."""

    dense: bool
    payloads: list[Any] = field(default_factory=list)


def compressor_from_config(system: Any) -> Compressor | None:
    """The downlink compressor ``system`` asks for (``None``: dense replies).

    Raises:
        ValueError: an unknown ``system.downlink_compression``.
    """
    kind = system.downlink_compression
    if kind == "none":
        return None
    if kind == "topk":
        return build_compressor("topk", ratio=system.downlink_ratio, selection=system.topk_selection)
    if kind == "quantization":
        return build_compressor(
            "quantization", bits=system.quantization_bits, bucket_size=system.quantization_bucket_size
        )
    raise ValueError(f"system.downlink_compression: must be none, topk or quantization, got {kind!r}")


class Downlink:
    """Encodes each reply's parameters for one worker (see the module docstring).

    Args:
        params: the server's parameter tensors (read at each :meth:`encode`).
        compressor: the delta compressor, or ``None`` for dense replies.
        refresh_interval: versions between dense refreshes of a worker.
        drift_bound: the largest relative distance a delta may leave between a worker and the server.
    """

    def __init__(
        self, params: list[torch.Tensor], compressor: Compressor | None, *, refresh_interval: int, drift_bound: float
    ):
        self.params = params
        self.compressor = compressor
        self.refresh_interval = refresh_interval
        self.drift_bound = drift_bound
        self._replica_of: dict[int, _Replica] = {}
        self._encoded: dict[tuple[int, tuple[int, ...], int], tuple[DownlinkReply, _Replica]] = {}
        self.refreshes = 0
        self.deltas = 0

    def forget(self, worker: int) -> None:
        """``worker`` holds nothing known (a new incarnation): its next reply is dense."""
        self._replica_of.pop(worker, None)

    def replica(self, worker: int) -> list[torch.Tensor] | None:
        """The parameters ``worker`` holds after its last reply (``None`` after a dense one... or none yet)."""
        replica = self._replica_of.get(worker)
        return replica.tensors if replica is not None else None

    def encode(self, worker: int, version: int) -> DownlinkReply:
        """The parameters for ``worker``'s reply at ``version`` (call with the server's lock held)."""
        replica = self._replica_of.get(worker)
        if self.compressor is None or replica is None or version - replica.refreshed_at >= self.refresh_interval:
            return self._refresh(worker, version)
        key = (replica.refreshed_at, replica.history, version)
        if key not in self._encoded:
            self._encoded = {k: v for k, v in self._encoded.items() if k[2] == version}  # older versions are done
            self._encoded[key] = self._delta(replica, version)
        reply, new_replica = self._encoded[key]
        if reply.dense:
            return self._refresh(worker, version)
        self._replica_of[worker] = new_replica
        self.deltas += 1
        return reply

    def _refresh(self, worker: int, version: int) -> DownlinkReply:
        if self.compressor is not None:  # dense replies without compression keep no replica at all
            self._replica_of[worker] = _Replica([p.detach().clone() for p in self.params], version)
        self.refreshes += 1
        return DownlinkReply(dense=True)

    def _delta(self, replica: _Replica, version: int) -> tuple[DownlinkReply, _Replica]:
        history = replica.history + (version,)
        generator = torch.Generator().manual_seed(hash((replica.refreshed_at, history)) & 0x7FFF_FFFF)
        payloads, tensors = [], []
        drift_sq = norm_sq = 0.0
        for param, held in zip(self.params, replica.tensors):
            current = param.detach()
            payload = self.compressor.compress(current - held, generator)
            updated = held + decompress(payload)
            payloads.append(payload)
            tensors.append(updated)
            drift_sq += float(torch.sum((current - updated) ** 2))
            norm_sq += float(torch.sum(current**2))
        if drift_sq > (self.drift_bound**2) * max(norm_sq, 1e-30):
            return DownlinkReply(dense=True), replica
        return DownlinkReply(dense=False, payloads=payloads), _Replica(tensors, replica.refreshed_at, history)
