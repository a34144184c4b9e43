"""The part of the model one parameter-server shard serves, and the whole model put back together from the parts.

With the server split across shards (:mod:`src.ps.shards.placement`), shard ``k`` serves :func:`shard_module`: an
``nn.Module`` whose parameters are its slices of the model's trainable parameters, flat (1-D) and named by
their slice keys (``layer1.0.conv1.weight``, or ``fc.weight#1`` for the second piece of a cut tensor), so the
server core serves a shard as it serves a whole model: the same :class:`~src.ps.state.aggregation.ModelState`, the
same layout checks against the slice names a sharded worker pushes
(:class:`~src.ps.worker.codec.PushCodec`), the same checkpoints. Shard 0 also holds every buffer of the
model whole (batch-norm statistics are a few kilobytes, and one shard must own them).

The server's optimizers are elementwise per tensor (SGD with momentum and weight decay, Adam, the async
corrections), so a step on the slices is the step on the whole tensor, element for element, to float32
rounding (a cut can move an element between torch's vectorized loop and its scalar tail, which round a fused
multiply-add differently): sync with S shards is sync with one (``tests/test_shard_model.py``).

:func:`whole_state` is the other way: the model's ``state_dict`` from the shards' ones (the parts of a cut
tensor joined in order, each tensor back in its shape), what the final checkpoint holds, so evaluation,
validation and the report read a sharded run's model as an unsharded one's.

Pure: no I/O, no processes.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from src.ps.shards.placement import DEFAULT_SLICE_BYTES, Placement, layout_of, place


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable parameters by name, in its order: what the placement splits."""
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def model_placement(model: nn.Module, num_shards: int, slice_bytes: int = DEFAULT_SLICE_BYTES) -> Placement:
    """The placement of ``model``'s trainable parameters over ``num_shards`` shards (every process computes it)."""
    return place(layout_of(trainable(model)), num_shards, slice_bytes)


def shard_module(model: nn.Module, placement: Placement, shard: int) -> nn.Module:
    """Shard ``shard``'s part of ``model``: its slices as flat parameters named by slice key (copies, not views),
    and on shard 0 every buffer of the model (copies), under the model's own names."""
    params = dict(trainable(model))
    missing = [s.name for s in placement.slices if s.name not in params]
    if missing:
        raise KeyError(f"the placement names tensors the model lacks: {', '.join(sorted(set(missing))[:5])}")
    part = nn.Module()
    for piece in placement.on_shard(shard):
        flat = params[piece.name].detach().reshape(-1)[piece.start : piece.stop]
        _register(part, piece.key, nn.Parameter(flat.clone()), buffer=False)
    if shard == 0:
        for name, buffer in model.named_buffers():
            _register(part, name, buffer.detach().clone(), buffer=True)
    return part


def whole_state(model: nn.Module, placement: Placement, shard_states: Sequence[Mapping[str, torch.Tensor]]):
    """``model``'s ``state_dict`` with its values from the shards' ``state_dict``\\ s (shard order): each trainable
    parameter joined from its slices and reshaped, every other entry (buffers, frozen parameters) from shard 0's
    state where it holds one, else ``model``'s own. Raises ``KeyError`` naming a slice no shard holds."""
    if len(shard_states) != placement.num_shards:
        raise ValueError(f"{len(shard_states)} shard states for a placement over {placement.num_shards} shards")
    parts = {s.key: shard_states[s.shard][s.key] for s in placement.slices if s.key in shard_states[s.shard]}
    flat = placement.assemble(parts, torch.cat)
    state = model.state_dict()
    whole = {}
    for name, value in state.items():
        if name in flat:
            whole[name] = flat[name].reshape(value.shape).clone()
        else:
            whole[name] = shard_states[0].get(name, value).clone()
    return whole


def _register(root: nn.Module, name: str, value: torch.Tensor, *, buffer: bool) -> None:
    """Put ``value`` at the dotted ``name`` under ``root``, making empty modules along the path, so the part's
    ``named_parameters`` and ``state_dict`` give back exactly ``name``."""
    *path, leaf = name.split(".")
    module = root
    for step in path:
        child = module._modules.get(step)
        if child is None:
            child = nn.Module()
            module.add_module(step, child)
        module = child
    if buffer:
        module.register_buffer(leaf, value)
    else:
        module.register_parameter(leaf, value)
