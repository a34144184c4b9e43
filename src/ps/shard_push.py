"""A worker's push cut by the shards' placement: each shard gets its slices, each verdict settles its slices only.

With the server split across shards (:mod:`src.ps.placement`), one step's gradient goes out as one push per
shard. :func:`shard_gradients` cuts the named gradients into each shard's slices (views of the flattened
gradients, in the placement's order); :class:`ShardedPushCodec` encodes each shard's slices through the
worker's one :class:`~src.ps.worker_protocol.PushCodec` (so the compression policy, the rounding generator
and the error feedback are the same objects as unsharded), with the residuals keyed by slice
(:attr:`~src.ps.placement.Slice.key`): compression and error feedback are per slice, and each shard's verdict
settles its slices (:meth:`ShardedPushCodec.settle`). Shard 0's reply says each shard's verdict (async: a shard
where the push was too stale rolls it back, the others apply it: :mod:`src.ps.shard_async`), so a shard's
rolled-back slices go back into their residuals alone, and no gradient mass is lost on any shard.

The way back: :func:`load_shard_reply` puts one shard's reply (its slices, and on shard 0 the buffers) into the
worker's whole model, so the worker trains on the model as the shards hold it together.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from src.ps.placement import Placement
from src.ps.worker_protocol import PushCodec, settle_lost_push, settle_push
from src.transport.wire import Received, copy_bytes_into


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

    def encode_slice(self, shard: int, position: int, gradient: torch.Tensor, step: int):
        """A streamed push (``system.streaming``): the payload of shard ``shard``'s slice ``position`` alone, cut from
        ``gradient`` (its whole tensor's), as soon as backward has produced it; as :meth:`encode` encodes it."""
        piece = self.placement.on_shard(shard)[position]
        return self.codec.encode([(piece.key, gradient.reshape(-1)[piece.start : piece.stop])], step)[0]

    def slices_of(self, names: Sequence[str]) -> list[list[tuple[int, int]]]:
        """For each tensor of ``names``: its slices as ``(shard, position on that shard)``."""
        where = {
            s.key: (k, i) for k in range(self.placement.num_shards) for i, s in enumerate(self.placement.on_shard(k))
        }
        return [[where[s.key] for s in self.placement.of_tensor(name)] for name in names]

    def settle(self, shard: int, *, accepted: bool) -> None:
        """Shard ``shard``'s verdict on its slices: commit their residuals, or roll them back."""
        settle_push(self.codec.feedback, self.keys[shard], accepted=accepted)

    def settle_lost(self, shard: int, *, applied: bool, redone: bool) -> None:
        """Shard ``shard``'s reply was lost; its registration says whether it was ``applied`` (as unsharded)."""
        settle_lost_push(self.codec.feedback, self.keys[shard], applied=applied, redone=redone)


def load_shard_reply(
    placement: Placement,
    shard: int,
    params: Mapping[str, torch.Tensor],
    buffers: Sequence[torch.Tensor],
    reply: Received,
) -> int:
    """Put shard ``shard``'s reply (a Pull or Push reply with its slices, dense, in the placement's order, and on
    shard 0 the buffers) into the worker's ``params`` (by name) and ``buffers`` (the model's float buffers, in
    order); returns the reply's version.

    Raises:
        ValueError: the reply holds another number of slices or buffers, or a slice of another size.
    """
    pieces = placement.on_shard(shard)
    sent, sent_buffers = reply.large["parameters"], reply.large["buffers"]
    expected_buffers = len(buffers) if shard == 0 else 0
    if len(sent) != len(pieces) or len(sent_buffers) != expected_buffers:
        raise ValueError(
            f"shard {shard} sent {len(sent)} slices and {len(sent_buffers)} buffers, the placement gives it "
            f"{len(pieces)} and {expected_buffers}"
        )
    for piece, data in zip(pieces, sent):
        copy_bytes_into(params[piece.name].data.view(-1)[piece.start : piece.stop], data, f"slice {piece.key}")
    for index, (buffer, data) in enumerate(zip(buffers, sent_buffers)):
        copy_bytes_into(buffer, data, f"buffer {index}")
    return reply.message.version
