"""Staleness of asynchronous pushes: how a push's age decides its weight, and how async momentum SGD
is corrected so that it trains like synchronous SGD.

**Staleness** of a push: ``tau = server version - worker version`` (the version the worker computed
its gradient on). Two parts, both pure (no I/O, no processes), usable by the parameter server, a
DDP variant or a user's own loop:

1. :class:`StalenessPolicy` (``system.staleness_policy``): ``verdict(tau) -> (weight, reason)``,
   ``weight`` ``None`` for a rejected push.

   * ``none``: every push at weight 1.
   * ``soft``: weight ``1 / (1 + beta * tau)`` (``system.staleness_beta``).
   * ``hard``: **Bounded Staleness**, reject ``tau > S_max`` (``system.max_staleness``); the worker
     then puts the whole compensated gradient back into its residual (**Residual Rollback**).
   * ``both``: the hard bound, then soft attenuation of what passes.

   The weight multiplies the push's gradient before the optimizer sees it, so: under SGD it scales
   the push's step (and, with momentum, its share of the momentum buffer, which keeps moving the
   parameters at full strength on later versions); weight decay is added by the optimizer after the
   weighting, so it is not attenuated; Adam divides by the root of its running mean of squared
   gradients, so a weight shrinks a push's step only relative to the pushes around it (a run whose
   pushes all have weight 0.5 takes the same steps as one with weight 1).

2. The **async correction** (``system.async_correction``), the default ``lookahead``:
   :class:`LookaheadMomentum`, the server-side optimizer for asynchronous SGD. Plain async SGD with
   momentum 0.9 diverges on the spec's runs: a push computed ``tau`` versions ago is applied on top
   of momentum that already carries those versions, and heavy-ball momentum with delayed gradients
   is stable only for a far smaller step than without delay (docs/async.md: on a quadratic with
   curvature ``lam``, one version of delay limits ``lr * lam / (1 - momentum)`` to 1, against 38
   without delay at momentum 0.9). The correction makes ``N`` asynchronous workers take the steps a
   synchronous barrier of ``N`` workers takes, with each gradient evaluated where it will land:

   * **per-worker momentum**: the server keeps one momentum buffer per worker and a push moves the
     parameters by ``s * lr / N`` times its own worker's buffer. With ``s = 1``, ``N`` pushes (one
     per worker) move the parameters by ``lr`` times the mean of the ``N`` buffers, which is
     synchronous momentum SGD on the mean gradient with the same ``lr`` and momentum (the linear
     scaling rule: a push carries ``1/N`` of the samples of a synchronous step).
   * **lookahead pulls**: a pull returns ``params - s * (lr / N) * momentum * sum(buffers)``, where the
     parameters will be once every worker's pending momentum has been applied, instead of where
     they are now. The gradient of a push is then computed close to the point it is applied at, so
     its staleness costs little (Hakimi et al., "Taming Momentum in a Distributed Asynchronous
     Environment", 2019, DANA). The model that is evaluated and checkpointed is ``params``.
   * **stability-matched step**: what the lookahead cannot predict (the other workers' fresh
     gradients) still narrows the stable range as N grows. On a quadratic with N workers pushing in
     turn, the largest stable ``lr * curvature`` is :func:`lookahead_stability_limit` (1.357 with
     one worker, Nesterov's limit, 1.119 with 2, 0.881 with 4 at momentum 0.9), so every push's step
     is multiplied by ``s = limit(N) / limit(1)`` (:func:`lookahead_step_scale`: 0.825 for 2
     workers, 0.649 for 4): N stale workers keep the stability margin of one worker without
     staleness. ``system.async_step_scale`` overrides it (1.0: exactly the synchronous steps).

   ``implicit_momentum``, the correction of Mitliagkas et al. ("Asynchrony begets momentum", 2016):
   ``N`` asynchronous workers add about ``1 - 1/N`` momentum of their own, so the explicit momentum
   becomes ``max(0, momentum - (1 - 1/N))`` (:func:`compensated_momentum`). Kept for comparison:
   it trains but reaches less in the same epochs (docs/async.md). ``none``: the plain optimizer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Literal

import numpy as np
import torch

from src.training.optimizers import optimizer_from_config

POLICIES = ("none", "soft", "hard", "both")
CORRECTIONS = ("none", "implicit_momentum", "lookahead")


@dataclass(frozen=True)
class StalenessPolicy:
    """Weigh or reject an asynchronous push by its staleness ``tau``.

    Args:
        kind: ``none``, ``soft``, ``hard`` or ``both`` (see the module docstring).
        beta: soft attenuation strength, ``weight = 1 / (1 + beta * tau)``; >= 0.
        max_staleness: S_max of the hard bound (``tau > S_max`` is rejected); >= 0.
    """

    kind: Literal["none", "soft", "hard", "both"] = "none"
    beta: float = 0.5
    max_staleness: int = 8

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"staleness policy must be one of {', '.join(POLICIES)}, got {self.kind!r}")
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"staleness beta must be a finite number >= 0, got {self.beta!r}")
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {self.max_staleness!r}")

    @classmethod
    def from_config(cls, system: Any) -> "StalenessPolicy":
        """From a ``system`` config section: ``staleness_policy``, ``staleness_beta``, ``max_staleness``."""
        return cls(system.staleness_policy, system.staleness_beta, system.max_staleness)

    def with_max_staleness(self, max_staleness: int) -> "StalenessPolicy":
        """The same policy with another S_max (the controller's decision)."""
        return replace(self, max_staleness=max_staleness)

    def verdict(self, tau: int) -> tuple[float | None, str]:
        """``(weight, reason)`` for a push of staleness ``tau``; ``weight`` is ``None`` when it is rejected.

        Raises:
            ValueError: ``tau`` is negative or not an int.
        """
        if not isinstance(tau, int) or isinstance(tau, bool) or tau < 0:
            raise ValueError(f"staleness must be an int >= 0, got {tau!r}")
        if self.kind in ("hard", "both") and tau > self.max_staleness:
            return None, f"staleness {tau} > max_staleness {self.max_staleness}"
        if self.kind in ("soft", "both"):
            weight = 1.0 / (1.0 + self.beta * tau)
            return weight, f"staleness {tau}: soft weight 1/(1+{self.beta:g}*{tau}) = {weight:.4g}"
        return 1.0, f"staleness {tau}: accepted at full weight"


def implicit_momentum(num_workers: int) -> float:
    """Momentum that ``num_workers`` asynchronous workers add by themselves, ``1 - 1/N`` (Mitliagkas et al.)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    return 1.0 - 1.0 / num_workers


def compensated_momentum(momentum: float, num_workers: int) -> float:
    """Explicit momentum that leaves ``momentum`` in total with ``num_workers`` async workers (>= 0)."""
    return max(0.0, momentum - implicit_momentum(num_workers))


STABILITY_MODEL_MAX_WORKERS = 32
"""Worker counts above this use the limit of this many (it has nearly converged: 0.706 at 32, 0.729 at 16)."""


def _lookahead_round_map(h: float, momentum: float, num_workers: int) -> np.ndarray:
    """The linear map of one round of round-robin pushes on ``f(x) = lam/2 x^2`` with ``h = lr * lam``.

    State: ``x``, each worker's momentum buffer ``v_k``, and each worker's lookahead point ``p_k``
    (where its next gradient is taken). Rows are updated in place, push by push.
    """
    n = num_workers
    x_row, v0, p0 = 0, 1, 1 + n
    rows = np.eye(1 + 2 * n)
    step = 1.0 / n
    for k in range(n):
        buffer = momentum * rows[v0 + k] + h * rows[p0 + k]
        position = rows[x_row] - step * buffer
        others = rows[v0 : v0 + n].sum(axis=0) - rows[v0 + k]
        rows[v0 + k] = buffer
        rows[x_row] = position
        rows[p0 + k] = position - step * momentum * (others + buffer)
    return rows


@functools.lru_cache(maxsize=256)
def lookahead_stability_limit(momentum: float, num_workers: int) -> float:
    """Largest ``lr * curvature`` at which :class:`LookaheadMomentum` (step scale 1) still converges on
    a quadratic with ``num_workers`` pushing in turn (each push ``num_workers - 1`` versions stale).

    With one worker it is Nesterov's limit ``2 (1 + momentum) / (1 + 2 momentum)``; it falls with N
    (momentum 0.9: 1.357, 1.119, 0.881, 0.777, 0.706 for N = 1, 2, 4, 8, 32). Found by bisection on
    the spectral radius of one round's linear map, after a scan that brackets the first unstable value.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    n = min(num_workers, STABILITY_MODEL_MAX_WORKERS)

    def stable(h: float) -> bool:
        return float(np.max(np.abs(np.linalg.eigvals(_lookahead_round_map(h, momentum, n))))) < 1.0

    stable_h = 1e-3
    for h in np.geomspace(1e-3, 16.0, 120)[1:]:
        if not stable(float(h)):
            unstable_h = float(h)
            break
        stable_h = float(h)
    else:
        return 16.0
    for _ in range(40):
        middle = 0.5 * (stable_h + unstable_h)
        if stable(middle):
            stable_h = middle
        else:
            unstable_h = middle
    return stable_h


def lookahead_step_scale(momentum: float, num_workers: int) -> float:
    """Step scale that gives N workers the stability margin of one: ``limit(N) / limit(1)`` (<= 1).

    Momentum 0.9: 1.0, 0.825, 0.649, 0.572 for N = 1, 2, 4, 8.
    """
    return min(1.0, lookahead_stability_limit(momentum, num_workers) / lookahead_stability_limit(momentum, 1))


class LookaheadMomentum(torch.optim.Optimizer):
    """Asynchronous SGD with per-worker momentum buffers and lookahead pulls (see the module docstring).

    A push from worker ``k``: put its gradient in ``param.grad``, then ``step(worker=k)``::

        d      = grad + weight_decay * param
        buf_k  = momentum * buf_k + d
        param -= step_scale * (lr / num_workers) * buf_k

    and :meth:`lookahead` gives what a pull should send, ``param - step_scale * (lr / num_workers) *
    momentum * sum_k buf_k``. With ``num_workers=1`` a step is torch's SGD step (same lr, momentum,
    weight decay); :meth:`lookahead` is then the Nesterov point. With ``step_scale=1``, one push per
    worker is exactly one synchronous momentum step on the mean gradient; the default
    (:func:`lookahead_step_scale`) shrinks the step so that N stale workers keep the stability margin
    of one worker (0.825 for 2 workers, 0.649 for 4 at momentum 0.9).

    State per parameter (``state_dict`` / checkpoints): ``momentum_buffers`` (``num_workers`` x the
    parameter's shape) and their running sum ``momentum_sum``.

    Args:
        params: parameters (or parameter groups) of the server's model.
        num_workers: N, the number of workers pushing (>= 1).
        lr, momentum, weight_decay: as for ``torch.optim.SGD`` in a synchronous run with N workers.
        step_scale: multiplies every push's step; ``None`` = :func:`lookahead_step_scale` of the
            group's momentum and ``num_workers``.
    """

    def __init__(
        self,
        params: Iterable,
        *,
        num_workers: int,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        step_scale: float | None = None,
    ):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        if step_scale is not None and not (math.isfinite(step_scale) and step_scale > 0):
            raise ValueError(f"step_scale must be a finite number > 0, got {step_scale!r}")
        self.num_workers = num_workers
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, step_scale=step_scale))
        for group in self.param_groups:
            if group["step_scale"] is None:
                group["step_scale"] = lookahead_step_scale(group["momentum"], num_workers)

    @classmethod
    def from_config(cls, config: Any, params: Iterable) -> "LookaheadMomentum":
        """From a run config (``training.learning_rate``, ``momentum``, ``weight_decay``, ``system.num_workers``,
        ``system.async_step_scale``)."""
        t = config.training
        return cls(
            params,
            num_workers=config.system.num_workers,
            lr=t.learning_rate,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            step_scale=config.system.async_step_scale,
        )

    def _state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[param]
        if not state:
            state["momentum_buffers"] = torch.zeros(
                (self.num_workers, *param.shape), dtype=param.dtype, device=param.device
            )
            state["momentum_sum"] = torch.zeros_like(param)
        return state

    @torch.no_grad()
    def step(self, closure=None, *, worker: int = 0):  # type: ignore[override]
        """Apply the gradients in ``param.grad`` as a push of ``worker`` (0..num_workers-1)."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in 0..{self.num_workers - 1}, got {worker}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            step_size = group["step_scale"] * group["lr"] / self.num_workers
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._state(param)
                buffer, total = state["momentum_buffers"][worker], state["momentum_sum"]
                gradient = param.grad
                if group["weight_decay"]:
                    gradient = gradient.add(param, alpha=group["weight_decay"])
                total.sub_(buffer)  # a running sum: one pass per push instead of N per pull
                buffer.mul_(group["momentum"]).add_(gradient)
                total.add_(buffer)
                param.sub_(buffer, alpha=step_size)
        return loss

    @torch.no_grad()
    def lookahead(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Where the parameters will be once every worker's pending momentum is applied (what a pull sends).

        Args:
            out: tensors to write into (one per parameter, in parameter order), e.g. reused pull buffers.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        result = out if out is not None else [torch.empty_like(p) for p in params]
        if len(result) != len(params):
            raise ValueError(f"lookahead: {len(result)} output tensors for {len(params)} parameters")
        index = 0
        for group in self.param_groups:
            scale = group["step_scale"] * group["lr"] / self.num_workers * group["momentum"]
            for param in group["params"]:
                state = self.state.get(param)
                if state and scale:
                    torch.sub(param, state["momentum_sum"], alpha=scale, out=result[index])
                else:
                    result[index].copy_(param)
                index += 1
        return result

    @torch.no_grad()
    def forget_worker(self, worker: int) -> None:
        """Drop ``worker``'s momentum (it finished or failed): its buffer no longer counts in lookaheads."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in 0..{self.num_workers - 1}, got {worker}")
        for state in self.state.values():
            buffer = state["momentum_buffers"][worker]
            state["momentum_sum"].sub_(buffer)
            buffer.zero_()


def server_optimizer(config: Any, params: Iterable, *, fused: bool = True) -> torch.optim.Optimizer:
    """The parameter server's optimizer for a run ``config``, with its async correction.

    async + ``lookahead`` + SGD: :class:`LookaheadMomentum`; async + ``implicit_momentum``: the
    configured optimizer with :func:`compensated_momentum`; otherwise the configured optimizer. The
    plain optimizers are torch's fused kernels (one pass per tensor; gradients only read, so they
    may be read-only views of a received message); ``fused=False`` gives torch's loop instead (what
    :mod:`src.studies.async_simulation` measured its figures with: the two round differently in the last bits).
    """
    t, system = config.training, config.system
    if system.aggregation_mode == "async" and system.async_correction == "lookahead" and t.optimizer == "sgd":
        return LookaheadMomentum.from_config(config, params)
    if system.aggregation_mode == "async" and system.async_correction == "implicit_momentum":
        momentum = compensated_momentum(t.momentum, system.num_workers)
        config = config.model_copy(update={"training": t.model_copy(update={"momentum": momentum})})
    return optimizer_from_config(config, params, fused=fused)
