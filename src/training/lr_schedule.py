"""Learning-rate schedules by step: ``training.lr_schedule``, the values torch's own schedulers give.

The baseline and DDP trainers set the rate of their optimizer step ``step`` (counted over the
whole run, restored from a checkpoint) with :func:`set_scheduled_learning_rate`. The parameter
server's optimizer takes one step per version, so its schedule is a function of the version: the update that makes
version ``v + 1`` uses :func:`scheduled_learning_rate` of ``v``
(the rate torch's scheduler holds after ``v`` calls of ``scheduler.step()``, i.e. during the
optimizer's ``v``-th step counted from 0). A resumed server continues the schedule from its
checkpoint's version; nothing else is stored.

Kinds (each after an optional linear warm-up of ``warmup_steps`` from ``warmup_start_factor`` x the
base rate up to it, as ``torch.optim.lr_scheduler.LinearLR`` followed by the kind in a
``SequentialLR`` with its milestone at ``warmup_steps``):

* ``constant``: the base rate (``training.learning_rate``).
* ``step``: the base rate x ``gamma`` every ``step_size`` steps (``StepLR``).
* ``cosine``: from the base rate down to ``min_lr`` over the steps from the warm-up's end to
  ``total_steps`` (``CosineAnnealingLR`` with ``T_max = total_steps - warmup_steps``), then ``min_lr``
  (torch's would climb back up: a run that outlasts ``total_steps`` stays at the floor instead).

Pure: no I/O; the caller sets the rate on its optimizer's groups before each step.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from src.common.validation import Section, bounded


class LRScheduleConfig(Section):
    """``training.lr_schedule``: the learning rate by step, applied by the parameter server's optimizer by
    version (sync and async; also the library's server) as torch's own schedulers would set it
    (:mod:`src.training.lr_schedule`). A resumed server continues it from its checkpoint's version."""

    kind: Literal["constant", "step", "cosine"] = "constant"
    """constant (training.learning_rate), step (x gamma every step_size steps), cosine (down to min_lr at
    total_steps)."""
    warmup_steps: int = bounded(0, ge=0, why="0 = no warm-up")
    """Linear warm-up first: from warmup_start_factor x the rate up to it over this many steps (0: none)."""
    warmup_start_factor: float = Field(0.1, gt=0, le=1)
    """The warm-up's first rate, as a fraction of training.learning_rate, in (0, 1]."""
    step_size: int = Field(default=0, validate_default=True)
    """step: steps between multiplications by gamma, > 0 (after the warm-up)."""
    gamma: float = Field(0.1, gt=0, le=1)
    """step: the factor, in (0, 1]."""
    total_steps: int = Field(default=0, validate_default=True)
    """cosine: the step at which the rate reaches min_lr, > warmup_steps (the warm-up counts in it)."""
    min_lr: float = Field(0.0, ge=0, allow_inf_nan=False)
    """cosine: the floor, >= 0."""

    @field_validator("step_size")
    @classmethod
    def _step_size_for_step(cls, value: int, info) -> int:
        if info.data.get("kind") == "step" and value <= 0:
            raise ValueError("must be > 0 with kind step (steps between multiplications by gamma)")
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    @field_validator("total_steps")
    @classmethod
    def _total_for_cosine(cls, value: int, info) -> int:
        warmup = info.data.get("warmup_steps") or 0
        if info.data.get("kind") == "cosine" and value <= warmup:
            raise ValueError(
                f"must be > training.lr_schedule.warmup_steps ({warmup}) with kind cosine "
                f"(the step at which the rate reaches min_lr)"
            )
        if value < 0:
            raise ValueError("must be >= 0")
        return value


def scheduled_learning_rate(schedule: Any, base_lr: float, step: int) -> float:
    """The learning rate of optimizer step ``step`` (from 0) under ``schedule`` (a ``training.lr_schedule``)."""
    warmup = schedule.warmup_steps
    if step < warmup:
        start = schedule.warmup_start_factor
        return base_lr * (start + (1.0 - start) * step / warmup)
    after = step - warmup
    if schedule.kind == "step":
        return base_lr * schedule.gamma ** (after // schedule.step_size)
    if schedule.kind == "cosine":
        span = schedule.total_steps - warmup
        if after >= span:
            return schedule.min_lr
        return schedule.min_lr + (base_lr - schedule.min_lr) * (1.0 + math.cos(math.pi * after / span)) / 2.0
    return base_lr


def set_scheduled_learning_rate(optimizer: Any, training: Any, step: int) -> float:
    """Set every parameter group of ``optimizer`` to ``training.lr_schedule``'s rate for step ``step``; returns it."""
    lr = scheduled_learning_rate(training.lr_schedule, training.learning_rate, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def is_constant(schedule: Any) -> bool:
    """Whether ``schedule`` keeps the base rate at every step."""
    return schedule.kind == "constant" and schedule.warmup_steps == 0


__all__ = ["is_constant", "scheduled_learning_rate", "set_scheduled_learning_rate"]
