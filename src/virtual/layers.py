"""The layers of a streamed worker's model in virtual time (``system.streaming``): what each layer's forward waits
for, how a step's compute spreads over the layers, the order backward hands the gradients over, and where a reply's
tensors end in its bytes.

A *layer* is what the real streamed worker's forward pre-hooks gate (:class:`src.ps.worker.streaming.StreamedModel`):
a module with parameters or buffers of its own, in the order the forward reaches them. Its forward waits for those
tensors of the reply; the modules without tensors that run after it (activations, pooling, flattening, the loss)
are part of its segment, since they need nothing more from the reply.

**How compute spreads over the layers** (:func:`layer_profile`): a deterministic proxy from the model's shapes, so
that a virtual run stays the same on every machine; or a measured split given as ``emulation.layer_split``
(:meth:`LayerProfile.with_split`). One forward of a batch of ``training.batch_size`` zeros (on a
copy of the model, without gradients) records every leaf module's input and output sizes; a leaf costs
``2 x MACs`` for a weighted operation (a convolution's or a linear layer's multiply-adds: its output's elements
times its weight's fan-in) plus :data:`ELEMENT_COST` per element it reads and writes (activations and pooling are
bound by memory, not arithmetic, on a CPU). Backward costs twice the multiply-adds of a weighted operation (the
input's gradient and the weight's), once for the operation that reads the model's input (no input gradient), and
the same element traffic. ``scripts/calibrate.py --layers`` prints this split beside the one measured with hooks on
this machine.

**The order of the gradients** (:class:`GradientOrder`): the real worker's own hooks (:class:`StreamedModel
<src.ps.worker.streaming.StreamedModel>`) on the compute model, recording the order in which backward hands each
gradient over (reverse layer order, as autograd produces them; the ones without a gradient after backward).

**A reply's tensors** (:func:`reply_pieces`): the byte offsets at which a reply's head (its small fields) and each of
its tensors are in, read from the reply's real bytes, so the virtual reply arrives as the real one is walked
(:class:`~src.transport.wire.MessageSplitter`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Hashable, Sequence

import numpy as np
import torch
from torch import nn

from src.config import Config, SetupError
from src.ps.worker.streaming import StreamedModel
from src.transport.wire import Received, split

ELEMENT_COST = 64.0
"""Floating-point operations a leaf module's element read or written costs as much as, in the proxy: on the CPUs
measured here an element moved through memory (ReLU, max pooling) costs about as long as 30-100 multiply-adds of a
small convolution (``scripts/calibrate.py --layers`` compares)."""

Key = tuple[str, int]
"""A reply tensor: ``("parameters", i)`` or ``("buffers", j)``, indices in the served order."""


@dataclass(frozen=True)
class LayerProfile:
    """A model's layers as a streamed step sees them (see the module docstring).

    Attributes:
        names: each layer's module name, in forward order.
        needs: each layer's reply tensors (what its forward waits for).
        weights: each layer's ``(forward, backward)`` weight in the proxy.
        layer_of: each parameter's layer (served order; -1: a parameter no layer's forward reached).
        param_bytes: each parameter's dense bytes (a part's share of the push's encoding time).
    """

    names: tuple[str, ...]
    needs: tuple[frozenset[Key], ...]
    weights: tuple[tuple[float, float], ...]
    layer_of: tuple[int, ...]
    param_bytes: tuple[int, ...]

    def with_split(self, split: Sequence[tuple[float, float]]) -> LayerProfile:
        """This profile with ``split`` (``emulation.layer_split``: a ``(forward, backward)`` weight per layer, in
        forward order) as its weights instead of the proxy's.

        Raises:
            ValueError: ``split`` has not one pair per layer (the message names the layers).
        """
        if len(split) != len(self.names):
            raise ValueError(
                f"emulation.layer_split has {len(split)} pairs; the model's streamed layers are {len(self.names)}: "
                f"{', '.join(name or '(input)' for name in self.names)} (scripts/calibrate.py --layers prints them)"
            )
        return replace(self, weights=tuple((float(f), float(b)) for f, b in split))

    def fractions(self) -> list[tuple[float, float]]:
        """Each layer's share of a step, forward and backward."""
        total = sum(f + b for f, b in self.weights) or 1.0
        return [(f / total, b / total) for f, b in self.weights]


def served_tensors(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model's parameters and float buffers in the served order (what pushes and replies carry)."""
    return (
        [p for p in model.parameters() if p.requires_grad],
        [b for b in model.buffers() if b.is_floating_point()],
    )


def layer_profile(model: nn.Module, sample: torch.Tensor, batch_size: int) -> LayerProfile:
    """The layers of ``model`` and the proxy's weights, from one forward of ``batch_size`` zeros shaped like
    ``sample`` (one input, without its batch dimension) on a copy of the model (nothing of ``model`` changes)."""
    copied = copy.deepcopy(model).eval()
    params, buffers = served_tensors(copied)
    param_index = {id(p): i for i, p in enumerate(params)}
    buffer_index = {id(b): i for i, b in enumerate(buffers)}
    names = {id(m): name for name, m in copied.named_modules()}
    layers: list[tuple[str, frozenset[Key]]] = []
    costs: list[list[float]] = []
    x = torch.zeros((batch_size, *sample.shape), dtype=sample.dtype)
    handles = []

    def gate(module: nn.Module, _args) -> None:
        own = frozenset(
            [("parameters", param_index[id(p)]) for p in module.parameters(recurse=False) if id(p) in param_index]
            + [("buffers", buffer_index[id(b)]) for b in module.buffers(recurse=False) if id(b) in buffer_index]
        )
        if own:
            layers.append((names[id(module)], own))
            costs.append([0.0, 0.0])

    def leaf(module: nn.Module, args, output) -> None:
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        outputs = [output] if isinstance(output, torch.Tensor) else [o for o in output if isinstance(o, torch.Tensor)]
        elements = sum(t.numel() for t in inputs + outputs)
        forward = backward = ELEMENT_COST * elements
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() >= 2 and outputs:
            macs = outputs[0].numel() * (weight.numel() // weight.shape[0])
            reads_input = bool(inputs) and inputs[0].data_ptr() == x.data_ptr()
            forward += 2 * macs
            backward += (1 if reads_input else 2) * 2 * macs
        if not costs:  # before the first layer: counted in it
            costs.append([0.0, 0.0])
            layers.append(("", frozenset()))
        costs[-1][0] += forward
        costs[-1][1] += backward

    for module in copied.modules():
        handles.append(module.register_forward_pre_hook(gate))
        if not list(module.children()):
            handles.append(module.register_forward_hook(leaf))
    with torch.no_grad():
        copied(x)
    for handle in handles:
        handle.remove()
    if layers and layers[0][0] == "" and len(layers) > 1:  # leaves before the first gated module: into it
        costs[1][0] += costs[0][0]
        costs[1][1] += costs[0][1]
        layers, costs = layers[1:], costs[1:]
    layer_of = [-1] * len(params)
    for number, (_, needs) in enumerate(layers):
        for name, index in needs:
            if name == "parameters" and layer_of[index] < 0:
                layer_of[index] = number
    return LayerProfile(
        names=tuple(name for name, _ in layers),
        needs=tuple(needs for _, needs in layers),
        weights=tuple((f, b) for f, b in costs),
        layer_of=tuple(layer_of),
        param_bytes=tuple(4 * p.numel() for p in params),
    )


def run_layers(model: nn.Module, sample: torch.Tensor, config: Config) -> LayerProfile:
    """The layers a run's step spreads over (a streamed PS worker's, a virtual DDP rank's): the shapes' proxy for a
    batch of ``training.batch_size`` inputs like ``sample``, weighted by ``emulation.layer_split`` where the config
    gives one (a split measured on some machine).

    Raises:
        SetupError: the split has not one pair per layer of the model (the message names the layers).
    """
    layers = layer_profile(model, sample, config.training.batch_size)
    if not config.emulation.layer_split:
        return layers
    try:
        return layers.with_split(config.emulation.layer_split)
    except ValueError as exc:
        raise SetupError(str(exc)) from None


class GradientOrder:
    """The order in which a streamed worker's backward hands the gradients over, by the real worker's hooks
    (:class:`~src.ps.worker.streaming.StreamedModel`) on ``model``: :meth:`begin` before a compute, :meth:`end` after
    it returns the indices (served order) in the order handed over, every parameter once."""

    def __init__(self, model: nn.Module):
        params, buffers = served_tensors(model)
        self.hooks = StreamedModel(model, params, buffers)
        self._order: list[int] = []

    def ready(self, index: int) -> None:  # the hooks' "stream"
        self._order.append(index)

    def begin(self) -> None:
        self._order = []
        self.hooks.begin_push(self)

    def end(self) -> list[int]:
        self.hooks.end_backward()
        order, self._order = self._order, []
        return order

    def close(self) -> None:
        self.hooks.close()


def _offset(view: memoryview, base: np.ndarray) -> int:
    """Where ``view`` (a view of the bytes ``base`` holds) starts in them."""
    if len(view) == 0:
        return -1
    return np.frombuffer(view, dtype=np.uint8).ctypes.data - base.ctypes.data


def reply_pieces(data: bytes, message_type, large_fields: Sequence[str]) -> tuple[int, list[tuple[int, Key]], Received]:
    """Where a reply's parts are in by: the byte count at which its head is in (the small fields, handed over when
    the walk reaches the first large field's bytes; the whole message when it has none) and, in byte order, the
    count at which each tensor is whole (``parameter_deltas`` are a parameter's: ``("parameters", i)``); and the
    reply, split (its tensors views of ``data``)."""
    received = split(data, message_type, large_fields)
    base = np.frombuffer(data, dtype=np.uint8)
    ends: list[tuple[int, int, Key]] = []
    for name, views in received.large.items():
        key_name = "parameters" if name == "parameter_deltas" else name
        for index, view in enumerate(views):
            start = _offset(view, base)
            if start >= 0:
                ends.append((start, start + len(view), (key_name, index)))
    ends.sort()
    head = ends[0][0] if ends else len(data)
    return head, [(end, key) for _, end, key in ends], received


def keys_of(profile: LayerProfile) -> set[Hashable]:
    """Every reply tensor some layer waits for."""
    return set().union(*profile.needs) if profile.needs else set()
