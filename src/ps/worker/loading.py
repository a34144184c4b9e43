"""The way back: a server's reply into the worker's tensors.

* :func:`served_tensors`: the module's tensors the server holds (trainable parameters, float buffers), named.
* :func:`load_reply`: a pull or push reply's parameters (dense, or downlink deltas added) and buffers.
* :func:`load_reply_tensor`: one tensor of a reply, whole or as a streamed reply brings it.
* :func:`load_shard_reply`: one shard's reply (its slices, and on shard 0 the buffers) into the whole model, so the
  worker trains on the model as the shards hold it together.

Pure: the replies come as :class:`~src.transport.wire.Received` (a message and views of its tensors' bytes).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from src.compression import decompress
from src.ps.shards.placement import Placement
from src.transport.wire import Received, copy_bytes_into


def served_tensors(
    module: torch.nn.Module,
) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.Tensor]]]:
    """What the server holds of ``module``: its trainable parameters (``named_parameters()`` order) and its
    floating-point buffers (batch-norm statistics), named."""
    return (
        [(n, p) for n, p in module.named_parameters() if p.requires_grad],
        [(n, b) for n, b in module.named_buffers() if b.is_floating_point()],
    )


def load_reply(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], reply: Received) -> int:
    """Put the parameters of a pull or push reply into ``params`` (dense values, or deltas to add) and its
    buffers into ``buffers``; returns its version.

    Raises:
        ValueError: the reply holds a different number of tensors, or a tensor of another size.
    """
    deltas = reply.large.get("parameter_deltas") or []
    sent_params, sent_buffers = deltas or reply.large["parameters"], reply.large["buffers"]
    if len(sent_params) != len(params) or len(sent_buffers) != len(buffers):
        raise ValueError(
            f"server sent {len(sent_params)} parameters and {len(sent_buffers)} buffers, "
            f"the local model has {len(params)} and {len(buffers)}"
        )
    field = "parameter_deltas" if deltas else "parameters"
    for index, (param, data) in enumerate(zip(params, sent_params)):
        load_reply_tensor(field, index, param, data)
    for index, (buffer, data) in enumerate(zip(buffers, sent_buffers)):
        load_reply_tensor("buffers", index, buffer, data)
    return reply.message.version


def load_reply_tensor(field: str, index: int, target: torch.Tensor, data) -> None:
    """One tensor of a reply into ``target``: a parameter's or a buffer's values, or a compressed downlink's delta
    added (the server's replica does the same). A whole reply (:func:`load_reply`) or a streamed one, tensor by tensor
    as it arrives (:mod:`src.ps.worker.streaming`).

    Raises:
        ValueError: ``data`` is not a tensor of ``target``'s size.
    """
    if field == "parameter_deltas":
        with torch.no_grad():
            target.add_(decompress(data, device=target.device).view_as(target).to(target.dtype))
    else:
        copy_bytes_into(target.data, data, f"{'buffer' if field == 'buffers' else 'parameter'} {index}")


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


__all__ = ["load_reply", "load_reply_tensor", "load_shard_reply", "served_tensors"]
