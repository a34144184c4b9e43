"""The adaptive compression controller's settings (:class:`ControllerSettings`): each one's default and bounds,
declared once.

:mod:`src.adaptive.controller` runs on them; :mod:`src.config` builds its ``system.controller_*`` fields from the
defaults and bounds below, so a run's config and a controller built by hand refuse the same values. A leaf
(no torch, no config), so both import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from src.common.bounds import bounds_rule, within

POLICIES = ("link", "rebound")
"""The controller's policies (``system.controller_policy``); the first is the default."""


def _setting(default: float, **bounds: float) -> Any:
    """A setting's default and its bounds, in pydantic's words (``gt``, ``ge``, ``lt``, ``le``): the config's
    ``system.controller_*`` fields are built from them (:mod:`src.config`)."""
    return field(default=default, metadata=bounds)


@dataclass(frozen=True)
class ControllerSettings:
    """Bounds and thresholds of the controller: the one declaration of each setting's default and bounds
    (the config's ``system.controller_*`` fields take theirs from here)."""

    rho_initial: float = _setting(0.1)
    """Active Fraction at the start (the run's ``compression_ratio``; the controller clamps it into the bounds)."""
    rho_min: float = _setting(0.01, gt=0, le=1)
    rho_max: float = _setting(0.5, gt=0, le=1)
    max_staleness_initial: int = _setting(8)
    """S_max at the start (clamped into the bounds too)."""
    max_staleness_min: int = _setting(1, ge=0)
    max_staleness_max: int = _setting(16, ge=0)
    rebound_threshold: float = _setting(0.05, ge=0)
    """Loss Rebound (nats) above which training counts as unstable."""
    rebound_window: int = _setting(3, ge=1)
    """Consecutive evaluation pairs the Loss Rebound averages over."""
    stable_evaluations: int = _setting(2, ge=1)
    """Evaluations in a row without a rebound before compressing more."""
    communication_share: float = _setting(0.5, ge=0, le=1)
    """Share of step time spent communicating at or above which communication dominates."""
    rho_factor: float = _setting(2.0, gt=1)
    """rho is multiplied (rebound) or divided (stable, communication-bound) by this."""
    instability_persistence: int = _setting(1, ge=1)
    """Unstable evaluations in a row before it compresses less (1: the first acts)."""
    policy: str = field(default="link")
    """How rho is chosen: ``link`` (the fastest predicted step, :mod:`src.adaptive.link_model`) or ``rebound``
    (halve rho while calm and communication-bound, the spec's first controller)."""
    step_slack: float = _setting(0.1, ge=0)
    """``link``, outside the critical regime: the densest rho whose predicted step is within this fraction of the
    fastest one is taken."""
    critical_drop: float = _setting(0.2, ge=0)
    """``link``: an evaluation whose loss fell by at least this fraction since the previous one is in the critical
    regime (early training: compression costs the most accuracy there, Accordion's finding)."""
    critical_slack: float = _setting(1.5, ge=0)
    """``link``, critical regime: the densest rho whose predicted step is within this fraction of the fastest."""

    def __post_init__(self) -> None:
        problems = []
        for setting in fields(self):
            value = getattr(self, setting.name)
            if setting.metadata and not (math.isfinite(value) and within(value, setting.metadata)):
                rule = bounds_rule(setting.metadata, finite=isinstance(setting.default, float))
                problems.append(f"{setting.name} must be {rule}, got {value}")
        if self.policy not in POLICIES:
            problems.append(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if not self.rho_min <= self.rho_max:
            problems.append(f"need rho_min <= rho_max, got rho_min={self.rho_min}, rho_max={self.rho_max}")
        if not self.max_staleness_min <= self.max_staleness_max:
            problems.append(
                f"need max_staleness_min <= max_staleness_max, got "
                f"{self.max_staleness_min} and {self.max_staleness_max}"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_config(cls, system: Any) -> "ControllerSettings":
        """Settings from a ``system`` config section (read by attribute; the initial values are clamped
        into the bounds, so a run whose ``compression_ratio`` lies outside them starts at the nearest bound)."""
        rho_min, rho_max = system.controller_rho_min, system.controller_rho_max
        s_min, s_max = system.controller_max_staleness_min, system.controller_max_staleness_max
        return cls(
            rho_initial=min(max(system.compression_ratio, rho_min), rho_max),
            rho_min=rho_min,
            rho_max=rho_max,
            max_staleness_initial=min(max(system.max_staleness, s_min), s_max),
            max_staleness_min=s_min,
            max_staleness_max=s_max,
            rebound_threshold=system.controller_rebound_threshold,
            rebound_window=system.controller_rebound_window,
            stable_evaluations=system.controller_stable_evaluations,
            communication_share=system.controller_communication_share,
            instability_persistence=system.controller_instability_persistence,
            policy=system.controller_policy,
            step_slack=system.controller_step_slack,
            critical_drop=system.controller_critical_drop,
            critical_slack=system.controller_critical_slack,
        )
