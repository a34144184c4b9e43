"""Adaptive compression: the event stream in, decisions on the Active Fraction rho and S_max out.

The controller reads only events, the same dicts that go to ``events.jsonl`` (delivered in process:
``MetricsLogger.event`` / ``scalars`` return them), and decides at each evaluation:

* **Loss Rebound** = the mean positive jump of the eval loss between consecutive evaluations, over
  the last ``rebound_window`` pairs: ``mean(max(0, L_i - L_{i-1}))``. A falling loss, however fast
  (the early drop of training), contributes nothing, so it is never mistaken for instability; raw
  spread or variance of the loss would be (settled invariant 2).
* Loss Rebound above ``rebound_threshold``: **compress less and bound staleness tighter**: rho is
  multiplied by ``rho_factor`` (up to ``rho_max``) and S_max halved (down to ``max_staleness_min``).
  The jump that triggered it is then forgotten (the window restarts at the latest loss), so one
  rebound acts once. With ``instability_persistence`` N > 1 (hysteresis), it acts only at the N-th
  unstable evaluation in a row: each earlier one is held (action ``hold_for_persistence``; its jump
  forgotten the same way, so the next evaluation needs a new rise), and a stable evaluation between
  them starts the count again.
* No rebound for ``stable_evaluations`` evaluations in a row **and communication dominating the
  step** (communication time over gradient + compression + communication time, summed over the
  pushes since the previous evaluation, at least ``communication_share``): **compress more**: rho is
  divided by ``rho_factor`` (down to ``rho_min``) and S_max relaxed by one (up to
  ``max_staleness_max``).
* Otherwise rho and S_max are held.

Every evaluation yields one decision event (``kind: "controller"``) with the new and previous
values, the action, the reason in words, and the inputs it was taken on, so a run's events say why
rho moved. A decision taken at the evaluation of step ``s`` applies from step ``s + 1``
(``apply_from_step``).

Decisions are a deterministic function of the sequence of events observed (no clock, no
randomness, the events' ``time`` field is not read), so every DDP rank fed the same events switches
at the same step. In DDP, feed ranks identical inputs: the eval loss (the same on every rank when
each rank evaluates the same model) and timings agreed across ranks (e.g. all-reduced at the
evaluation step), or let rank 0 decide and broadcast ``(rho, max_staleness, apply_from_step)``.

Tuning: ``rebound_threshold`` is in loss units (cross-entropy, nats): a rebound of 0.05 on a loss
near 0.3 is a visible setback; ``rebound_window`` trades reaction time for robustness to one noisy
evaluation; evaluate often enough (``training.eval_interval``) that the controller gets a say.

    controller = CompressionController.from_config(config.system)
    for event in stream:                       # push events with timing fields, eval events
        decision = controller.observe(event)   # None, or a decision event dict
        if decision is not None:
            log.event(**decision)               # workers use decision["rho"] from apply_from_step
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import fields
from typing import Any, Mapping

from src.adaptive.link_model import LinkModel, WindowSums
from src.adaptive.settings import ControllerSettings

TIMING_FIELDS = ("gradient_time_s", "compression_time_s", "communication_time_s")
"""Fields of push events the controller sums to judge whether communication dominates the step."""


def _rate(throughput: float) -> str:
    return "no measurable transfer time" if not math.isfinite(throughput) else f"{throughput * 8 / 1e6:.4g} Mbit/s"


def loss_rebound(losses: list[float]) -> float:
    """Mean positive jump between consecutive losses (0.0 for fewer than two)."""
    jumps = [max(0.0, later - earlier) for earlier, later in zip(losses, losses[1:])]
    return sum(jumps) / len(jumps) if jumps else 0.0


class CompressionController:
    """Event-driven controller of rho (top-k Active Fraction) and S_max; see the module docstring.

    Attributes:
        rho: the current Active Fraction.
        max_staleness: the current S_max.
    """

    def __init__(self, settings: ControllerSettings | None = None):
        self.settings = settings or ControllerSettings()
        s = self.settings
        self.rho = min(max(s.rho_initial, s.rho_min), s.rho_max)
        self.max_staleness = min(max(s.max_staleness_initial, s.max_staleness_min), s.max_staleness_max)
        self._losses: deque[float] = deque(maxlen=s.rebound_window + 1)
        self._timing = dict.fromkeys(TIMING_FIELDS, 0.0)
        self._timed_pushes = 0
        self._stable_streak = 0
        self._unstable_streak = 0
        self.link = LinkModel()
        """``link`` policy: the fitted cost of a push at each rho."""
        self._window = WindowSums()
        self._window_rhos: deque[float] = deque([self.rho] * 3, maxlen=3)
        """rho in effect in the last three windows (a push's payload is reported a window late, at worst)."""
        self._probe_from: float | None = None
        self.floor = s.rho_min
        """``link``: the lowest rho it may choose (a rebound raises it)."""
        self._previous_loss: float | None = None

    @classmethod
    def from_config(cls, system: Any) -> "CompressionController":
        return cls(ControllerSettings.from_config(system))

    def observe(self, event: Mapping[str, Any]) -> dict[str, Any] | None:
        """Take one event; returns a decision event at an evaluation, else ``None``.

        Push events (``kind: "push"``) contribute their timing fields (:data:`TIMING_FIELDS`, those
        present); eval events (``kind: "eval"``, with ``test_loss`` and ``step``) trigger a
        decision. Other kinds are ignored.

        Raises:
            ValueError: an eval event without a finite ``test_loss`` or an integer ``step``.
        """
        kind = event.get("kind")
        if kind == "push":
            timed = False
            for name in TIMING_FIELDS:
                value = event.get(name)
                if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
                    self._timing[name] += value
                    timed = True
            self._timed_pushes += timed
            self._window.add(event)
            return None
        if kind != "eval":
            return None
        loss, step = event.get("test_loss"), event.get("step")
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise ValueError(f"controller: eval event needs a finite test_loss, got {loss!r}")
        if not isinstance(step, int):
            raise ValueError(f"controller: eval event needs an integer step, got {step!r}")
        return self._decide(float(loss), step)

    def communication_share(self) -> float | None:
        """Communication time / step time over the pushes since the last evaluation (None: no timings)."""
        total = sum(self._timing.values())
        return self._timing["communication_time_s"] / total if total > 0 else None

    def _decide(self, loss: float, step: int) -> dict[str, Any]:
        s = self.settings
        self._losses.append(loss)
        losses = list(self._losses)
        rebound = loss_rebound(losses)
        share = self.communication_share()
        previous = (self.rho, self.max_staleness)
        link_inputs: dict[str, Any] = {}
        if len(losses) >= 2 and rebound > s.rebound_threshold:
            action, reason = self._unstable(rebound)
            self._losses.clear()
            self._losses.append(loss)  # this jump has been counted
            self.floor = max(self.floor, self.rho)  # link: it stays at least this dense
        elif s.policy == "link":
            action, reason, link_inputs = self._link_decision(rebound, loss)
        elif len(losses) < 2:
            action, reason = "hold", "first evaluation of the window: no Loss Rebound yet"
        else:
            action, reason = self._calm(rebound, share)
        self._window_rhos.append(self.rho)
        if self._window.pushes:  # an evaluation with no push since the last (an epoch's end) is no new reading
            self._previous_loss = loss
        if action in ("compress_less", "compress_more") and (self.rho, self.max_staleness) == previous:
            action, reason = "hold", f"{reason} (already at the bound)"
        decision = {
            "kind": "controller",
            "step": step,
            "apply_from_step": step + 1,
            "action": action,
            "rho": self.rho,
            "max_staleness": self.max_staleness,
            "previous_rho": previous[0],
            "previous_max_staleness": previous[1],
            "reason": reason,
            "inputs": {
                "test_loss": loss,
                "losses_in_window": losses,
                "loss_rebound": rebound,
                "rebound_threshold": s.rebound_threshold,
                "stable_evaluations": self._stable_streak,
                "unstable_evaluations": self._unstable_streak,
                "communication_share": share,
                "timed_pushes": self._timed_pushes,
                **{name: self._timing[name] for name in TIMING_FIELDS},
                **link_inputs,
            },
        }
        self._timing = dict.fromkeys(TIMING_FIELDS, 0.0)
        self._timed_pushes = 0
        self._window = WindowSums()
        return decision

    def _unstable(self, rebound: float) -> tuple[str, str]:
        """A Loss Rebound above the threshold: compress less and bound staleness tighter (or hold, for persistence)."""
        s = self.settings
        self._stable_streak = 0
        self._unstable_streak += 1
        unstable = f"Loss Rebound {rebound:.4g} > {s.rebound_threshold:g}"
        if self._unstable_streak < s.instability_persistence:
            return "hold_for_persistence", (
                f"{unstable} at {self._unstable_streak} evaluation(s) in a row, need "
                f"{s.instability_persistence} (instability_persistence): held"
            )
        self._unstable_streak = 0
        self.rho = self._denser(self.rho)
        self.max_staleness = max(s.max_staleness_min, self.max_staleness // 2)
        return "compress_less", f"{unstable}: compress less, bound staleness tighter"

    def _calm(self, rebound: float, share: float | None) -> tuple[str, str]:
        """The ``rebound`` policy without a rebound: compress more once calm long enough and communication-bound."""
        s = self.settings
        self._unstable_streak = 0
        self._stable_streak += 1
        stable = f"Loss Rebound {rebound:.4g} <= {s.rebound_threshold:g} for {self._stable_streak} evaluation(s)"
        if self._stable_streak < s.stable_evaluations:
            return "hold", f"{stable}, need {s.stable_evaluations}"
        if share is None:
            return "hold", f"{stable}, but no push timings to judge communication by"
        if share < s.communication_share:
            return "hold", f"{stable}, communication share {share:.3f} < {s.communication_share:g}"
        self._stable_streak = 0
        self.rho = max(s.rho_min, self.rho / s.rho_factor)
        self.max_staleness = min(s.max_staleness_max, self.max_staleness + 1)
        share_text = f"communication share {share:.3f} >= {s.communication_share:g}"
        return "compress_more", f"{stable} and {share_text}: compress more"

    def levels(self) -> list[float]:
        """The Active Fractions the ``link`` policy chooses among: ``rho_min`` times powers of ``rho_factor`` up to
        ``rho_max``, ``rho_max`` itself, and 1.0 (no compression) when ``rho_max`` is 1."""
        s = self.settings
        levels, rho = [], s.rho_min
        while rho < s.rho_max and len(levels) < 64:
            levels.append(rho)
            rho *= s.rho_factor
        return levels + [s.rho_max]

    def _denser(self, rho: float) -> float:
        """The next Active Fraction up (``rho_factor`` times, at most ``rho_max``)."""
        return min(self.settings.rho_max, rho * self.settings.rho_factor)

    def _link_decision(self, rebound: float, loss: float) -> tuple[str, str, dict[str, Any]]:
        """The ``link`` policy without a rebound: the densest level whose predicted step is within a slack of the
        fastest (``critical_slack`` while the loss falls fast, ``step_slack`` once it does not), among those at or
        above the floor, which a rebound raises; a probe at another level first, while one payload size cannot
        split the link's fixed cost from its throughput."""
        s, link = self.settings, self.link
        calm = f"Loss Rebound {rebound:.4g} <= {s.rebound_threshold:g}"
        before = self._previous_loss
        critical = before is None or before - loss >= s.critical_drop * before
        slack = s.critical_slack if critical else s.step_slack
        calm += (
            "; critical: the loss is falling fast (first evaluation)"
            if before is None
            else f"; {'critical' if critical else 'calm'}: the loss fell {(before - loss) / before:.1%} "
            f"({'>=' if critical else '<'} {s.critical_drop:g})"
        )
        self._unstable_streak = 0
        self._stable_streak += 1
        if self._stable_streak >= s.stable_evaluations:
            self._stable_streak = 0
            self.max_staleness = min(s.max_staleness_max, self.max_staleness + 1)
        point = self._window.point()
        rhos = self._window_rhos
        if point is not None:
            link.update(point, rhos[-1] if len(set(rhos)) == 1 else None)
        if point is None:
            return "hold", f"{calm}; no push paired its payload bytes with its communication time yet", {}
        if not link.fitted:
            if self._probe_from is not None:
                return "hold", f"{calm}; probe: waiting for payloads at rho {self.rho:g} to fit the link", {}
            self._probe_from = self.rho
            # toward the smaller payload, which costs no time, unless already at the floor
            down = max(self.floor, self.rho / s.rho_factor)
            self.rho = down if down < self.rho else self._denser(self.rho)
            return (
                "probe",
                f"{calm}; probe: one payload size ({point.payload_bytes:.0f} bytes) cannot split the link's fixed cost "
                f"from its throughput, so one window at rho {self.rho:g}",
                {},
            )
        predicted = {level: link.step_s(level) for level in self.levels() if level >= self.floor}
        known = {level: t for level, t in predicted.items() if t is not None}
        inputs = {
            "floor": self.floor,
            "fixed_s": link.fixed_s,
            "throughput_bytes_per_s": link.throughput if math.isfinite(link.throughput) else None,
            "predicted_step_s": {f"{level:g}": t for level, t in known.items()},
        }
        if not known:
            return "hold", f"{calm}; the link model cannot predict a step yet", inputs
        fastest = min(known.values())
        choice = max(level for level, t in known.items() if t <= (1 + slack) * fastest)
        name = "no compression" if choice >= 1 else f"rho {choice:g}"
        why = (
            f"{calm}; predicted step {known[choice]:.4g} s at {name}, the fastest {fastest:.4g} s "
            f"(fixed {link.fixed_s:.4g} s, {_rate(link.throughput)}): the densest within {slack:g} of it"
        )
        if choice == self.rho:
            return "hold", why, inputs
        action = "compress_less" if choice > self.rho else "compress_more"
        self.rho = choice
        return action, why, inputs

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to take the same decisions (plain JSON-able values)."""
        return {
            "rho": self.rho,
            "max_staleness": self.max_staleness,
            "losses": list(self._losses),
            "timing": dict(self._timing),
            "timed_pushes": self._timed_pushes,
            "stable_streak": self._stable_streak,
            "unstable_streak": self._unstable_streak,
            "link": self.link.state_dict(),
            "window": self._window.state_dict(),
            "window_rhos": list(self._window_rhos),
            "probe_from": self._probe_from,
            "floor": self.floor,
            "previous_loss": self._previous_loss,
            "settings": {f.name: getattr(self.settings, f.name) for f in fields(self.settings)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.settings = ControllerSettings(**state["settings"])
        self.rho, self.max_staleness = float(state["rho"]), int(state["max_staleness"])
        self._losses = deque((float(x) for x in state["losses"]), maxlen=self.settings.rebound_window + 1)
        self._timing = {name: float(state["timing"][name]) for name in TIMING_FIELDS}
        self._timed_pushes = int(state["timed_pushes"])
        self._stable_streak = int(state["stable_streak"])
        self._unstable_streak = int(state.get("unstable_streak", 0))  # absent in checkpoints before the knob
        if "link" in state:  # absent in checkpoints before the link policy
            self.link = LinkModel.from_state(state["link"])
            self._window.load_state_dict(state["window"])
            self._window_rhos = deque((float(x) for x in state["window_rhos"]), maxlen=3)
            self._probe_from = state["probe_from"]
            self.floor, self._previous_loss = float(state["floor"]), state["previous_loss"]
