"""The optimizer registry: ``training.optimizer`` -> a torch optimizer (plain or fused).

Free of I/O and of the trainer's imports, so the server's update rule (:func:`src.staleness.server_optimizer`)
reaches it without data loading, checkpoints or trackers.
"""

from __future__ import annotations

from typing import Any

import torch


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
