"""The optimizer registry: ``training.optimizer`` -> a torch optimizer (plain or fused), and one step of it
with given gradients (:func:`apply_gradients`, the parameter server's update).

Free of I/O and of the trainer's imports, so the server's update rule (:func:`src.ps.state.staleness.server_optimizer`)
reaches it without data loading, checkpoints or trackers.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.optim import optimizer as _torch_optimizer
from torch.optim.sgd import sgd


def build_optimizer(
    name: str, params, *, learning_rate: float, momentum: float, weight_decay: float, fused: bool = False
) -> torch.optim.Optimizer:
    """``sgd`` (with momentum) or ``adam`` over ``params``.

    ``fused`` asks for torch's single-kernel implementation (same update rule, one pass over each
    parameter, gradients only read); it needs floating-point parameters on a device it supports.
    """
    options = {"fused": True} if fused else {}
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=momentum, weight_decay=weight_decay, **options)
    if name == "adam":
        return torch.optim.Adam(params, lr=learning_rate, weight_decay=weight_decay, **options)
    raise ValueError(f"training.optimizer: must be sgd or adam, got {name!r}")


def optimizer_from_config(config: Any, params, *, fused: bool = False) -> torch.optim.Optimizer:
    """The run ``config``'s optimizer (``training.optimizer``, its rate, momentum and decay) over ``params``."""
    t = config.training
    return build_optimizer(
        t.optimizer,
        params,
        learning_rate=t.learning_rate,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        fused=fused,
    )


def apply_gradients(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], gradients: Sequence) -> None:
    """One step of ``optimizer`` with ``gradients`` (one per tensor of ``params``, in order; only read).

    For torch's SGD once its momentum buffers exist, with no step hooks registered, this calls the
    update ``SGD.step`` itself calls (``torch.optim.sgd.sgd``: the same kernel, fused or not as the
    optimizer was built, the same arguments), so the result is ``step()``'s bit for bit, without the
    wrapper's per-call work (a profiler label, hook dispatch, gathering ``.grad``): 0.19 ms instead of
    0.28 for a 1 MB model's step here, a third of the step at the sizes a parameter server answers
    many times a second. Anything else (another optimizer, the first step, hooks) sets ``.grad`` and
    calls ``optimizer.step()``; ``.grad`` is cleared after, so no gradient outlives its step.
    """
    groups = _direct_sgd_groups(optimizer, params, gradients)
    if groups is None:
        for param, gradient in zip(params, gradients):
            param.grad = gradient.to(param.device)
        try:
            optimizer.step()
        finally:
            for param in params:
                param.grad = None
        return
    with torch.no_grad():
        for group, group_params, group_gradients, buffers in groups:
            _sgd_update(group, group_params, group_gradients, buffers)


def _sgd_update(group: dict, params: list, gradients: list, buffers: list) -> None:
    """Torch's SGD update of ``params`` in place, with ``group``'s arguments, as ``SGD.step`` calls it."""
    sgd(
        params,
        gradients,
        buffers,
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
        has_sparse_grad=False,
        foreach=group["foreach"],
        fused=group["fused"],
    )


def _direct_sgd_groups(optimizer, params, gradients) -> list | None:
    """Per parameter group: (group, its parameters, their gradients, their momentum buffers), when the
    direct SGD update applies (see :func:`apply_gradients`); else ``None``."""
    if type(optimizer) is not torch.optim.SGD or not _no_step_hooks(optimizer):
        return None
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return None
    groups = optimizer.param_groups
    if len(groups) == 1 and len(groups[0]["params"]) == len(params):
        if all(a is b for a, b in zip(groups[0]["params"], params)):  # the server's case: one group, in order
            return _direct_group(optimizer, groups[0], list(params), list(gradients))
    by_param = {id(param): gradient for param, gradient in zip(params, gradients)}
    direct = []
    for group in groups:
        group_params = [param for param in group["params"] if id(param) in by_param]
        one = _direct_group(optimizer, group, group_params, [by_param[id(param)] for param in group_params])
        if one is None:
            return None
        direct += one
    return direct


def _direct_group(optimizer, group, params: list, gradients: list) -> list | None:
    if group.get("differentiable") or any(gradient.is_sparse for gradient in gradients):
        return None
    gradients = [gradient.to(param.device) for param, gradient in zip(params, gradients)]
    if group["momentum"] == 0:
        return [(group, params, gradients, [None] * len(params))]
    state = optimizer.state
    buffers = [state[param].get("momentum_buffer") for param in params]
    if any(buffer is None for buffer in buffers):
        return None  # the first step: step() creates the buffers
    return [(group, params, gradients, buffers)]


def _no_step_hooks(optimizer) -> bool:
    """No step pre- or post-hook registered, on ``optimizer`` or globally (unknown: assume some are)."""
    hook_dicts = (
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
        getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
        getattr(_torch_optimizer, "_global_optimizer_post_hooks", None),
    )
    return all(hooks is not None and not hooks for hooks in hook_dicts)


def stepped_slice(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, gradient: torch.Tensor, start: int, stop: int
) -> torch.Tensor | None:
    """What elements ``start:stop`` of ``param`` (flat) would hold after one :func:`apply_gradients` step whose
    gradient of ``param`` has ``gradient`` (flat, those elements) there; nothing changes. ``None`` where the step
    cannot be told from a slice: an optimizer other than torch's SGD, a step hook, or a parameter it does not hold.

    Torch's SGD update is elementwise, so a slice's step is the same arithmetic on fewer elements; the sliced
    call runs the same function :func:`apply_gradients` calls (``torch.optim.sgd.sgd`` with the group's arguments),
    on a copy of the slice and of its momentum buffer (a first step: none, as ``step()`` starts it). A caller that
    relies on the result being bit for bit the step's compares the two (:mod:`src.ps.state.slice_pipeline` does).
    """
    if type(optimizer) is not torch.optim.SGD or not _no_step_hooks(optimizer):
        return None
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
    if group is None or group.get("differentiable") or gradient.is_sparse:
        return None
    value = param.detach().reshape(-1)[start:stop].clone()
    buffer = None
    if group["momentum"] != 0:
        held = optimizer.state.get(param, {}).get("momentum_buffer")
        buffer = None if held is None else held.reshape(-1)[start:stop].clone()
    with torch.no_grad():
        _sgd_update(group, [value], [gradient.to(value.device)], [buffer])
    return value
