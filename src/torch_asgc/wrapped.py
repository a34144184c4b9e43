"""The torch optimizer a :class:`~torch_asgc.optim.DistributedOptimizer` stands in for: :class:`WrappedOptimizer`.

A user's loop, its LR schedulers, GradScaler and integrations talk to the optimizer they built. The
DistributedOptimizer is one (a ``torch.optim.Optimizer``, its step hooks and profiler labels included) whose
``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so a scheduler drives the wrapped one's rates
and a checkpoint holds its state; only ``step()`` is its own. :func:`differences` names how the wrapped optimizer's
hyperparameters differ from the server's (the server's optimizer is the one that steps).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


def differences(optimizer: torch.optim.Optimizer, training: Any) -> list[str]:
    """How the wrapped optimizer's hyperparameters differ from the server's."""
    kinds = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}
    if type(optimizer) is not kinds[training.optimizer]:
        return [f"it is {type(optimizer).__name__}, the server's is {training.optimizer}"]
    expected = {"lr": training.learning_rate, "weight_decay": training.weight_decay}
    if training.optimizer == "sgd":
        expected["momentum"] = training.momentum
    found = []
    for group in optimizer.param_groups:
        for key, value in expected.items():
            if key in group and abs(float(group[key]) - value) > 1e-12:
                found.append(f"{key} {group[key]} (server: {value})")
    return sorted(set(found))


class WrappedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose groups, state and defaults are ``optimizer``'s (see the module docstring)."""

    _step_supports_amp_scaling = True  # GradScaler calls step() with grad_scale / found_inf set, every iteration

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.wrapped = optimizer
        # torch.optim.Optimizer's bookkeeping without its __init__ (which would reset the wrapped state)
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        if hasattr(self, "_patch_step_function"):
            self._patch_step_function()  # step hooks and profiler labels, as for any optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.wrapped.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.wrapped.param_groups = value

    @property
    def state(self) -> Any:
        return self.wrapped.state

    @state.setter
    def state(self, value: Any) -> None:
        self.wrapped.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.wrapped.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.wrapped.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.wrapped.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.wrapped!r})"

    def _mark_wrapped_stepped(self) -> None:
        # An LR scheduler built on the wrapped optimizer checks that it was stepped before the
        # scheduler steps; the step is ours, so say so (avoids a misleading warning).
        self.wrapped._opt_called = True  # noqa: SLF001


__all__ = ["WrappedOptimizer", "differences"]
