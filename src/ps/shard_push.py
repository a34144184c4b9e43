"""A worker's push cut by the shards' placement: each shard gets its slices, each verdict settles its slices only.

With the server split across shards (:mod:`src.ps.placement`), one step's gradient goes out as one push per
shard. :func:`shard_gradients` cuts the named gradients into each shard's slices (views of the flattened
gradients, in the placement's order); :class:`ShardedPushCodec` encodes each shard's slices through the
worker's one :class:`~src.ps.worker_protocol.PushCodec` (so the compression policy, the rounding generator
and the error feedback are the same objects as unsharded), with the residuals keyed by slice
(:attr:`~src.ps.placement.Slice.key`): compression and error feedback are per slice. A verdict concerns one
shard: a push rejected by one shard (async, its own staleness) rolls back that shard's slices only, the
spec's Residual Rollback per slice, and no gradient mass is lost on any shard.

The first piece of the sharded server's worker side (issue 33): the server shards and the worker's
connections to them are not built yet, so no driver calls this today.
"""

from __future__ import annotations

from typing import Iterable

import torch

from src.ps.placement import Placement
from src.ps.worker_protocol import PushCodec, settle_lost_push, settle_push


def shard_gradients(
    placement: Placement, named_gradients: Iterable[tuple[str, torch.Tensor]]
) -> list[list[tuple[str, torch.Tensor]]]:
    """Each shard's ``(slice key, elements)``, the elements a view of the flattened gradient (no copy)."""
    flat = {name: gradient.reshape(-1) for name, gradient in named_gradients}
    missing = [s.name for s in placement.slices if s.name not in flat]
    if missing:
        raise KeyError(f"no gradient for the placed tensors {', '.join(sorted(set(missing))[:5])}")
    return [
        [(piece.key, elements) for piece, elements in placement.split(flat, shard)]
        for shard in range(placement.num_shards)
    ]


class ShardedPushCodec:
    """One worker's encode and settle over the shards (see the module docstring).

    Args:
        placement: the model over the shards (every process computes the same one).
        codec: the worker's push codec: its policy, error feedback and rounding generator.
    """

    def __init__(self, placement: Placement, codec: PushCodec):
        self.placement = placement
        self.codec = codec
        self.keys = [[s.key for s in placement.on_shard(k)] for k in range(placement.num_shards)]

    def encode(self, named_gradients: Iterable[tuple[str, torch.Tensor]], step: int) -> list[list[bytes]]:
        """Each shard's payloads, one per slice in the placement's order; the residuals wait for :meth:`settle`."""
        return [self.codec.encode(slices, step) for slices in shard_gradients(self.placement, named_gradients)]

    def settle(self, shard: int, *, accepted: bool) -> None:
        """Shard ``shard``'s verdict on its slices: commit their residuals, or roll them back."""
        settle_push(self.codec.feedback, self.keys[shard], accepted=accepted)

    def settle_lost(self, shard: int, *, applied: bool, redone: bool) -> None:
        """Shard ``shard``'s reply was lost; its registration says whether it was ``applied`` (as unsharded)."""
        settle_lost_push(self.codec.feedback, self.keys[shard], applied=applied, redone=redone)
