"""The adaptive compression controller in DDP: rank 0 decides, every rank switches at the same step.

:class:`src.adaptive.controller.CompressionController` decides at evaluations from a stream of events. In
DDP the compression hook ``all_gather``s every rank's payloads, which needs payloads of equal size on
every rank: all ranks must compress with the same top-k Active Fraction rho at every step. So one
controller decides, on rank 0, and the decision travels to every rank:

* **Timing** (rank 0): after each training step, the controller gets a push-like event
  ``{"kind": "push", "gradient_time_s", "communication_time_s"}``. ``communication_time_s`` is the
  step's exchange time, ``CommStats.hook_seconds`` (the hook's thread compressing, ``all_gather``ing
  and decompressing the step's buckets; compression is inside it, so no separate
  ``compression_time_s``); ``gradient_time_s`` is the rest of the step's wall time (forward,
  backward, optimizer step). The hook overlaps the backward pass, so the communication share the
  controller computes, exchange / step wall time, is the share of the step during which the
  exchange was running, overlapped time included: more than the exchange adds to the step's length
  when it hides behind the backward pass. Rank 0's own steps are what it judges by (every rank runs
  the same collectives, so their exchanges take about as long).
* **Decision** (:meth:`RankControl.decide`, a collective, at every evaluation: every
  ``training.eval_interval`` steps and at epoch ends): rank 0's controller observes the eval event
  and ``(rho, max_staleness, apply_from_step, action)`` is broadcast from rank 0 as one small
  float64 tensor (exact for these values). Every rank records the switch it implies.
* **Switch** (:meth:`RankControl.due`, before each step): from step ``apply_from_step`` (1-based
  numbering: the evaluation after step s decides for step s + 1 on) every rank sets its hook's
  top-k ratio (:meth:`src.ddp.comm_hooks.CommHook.set_topk_ratio`) between steps, when no exchange is
  in flight. S_max has no meaning in synchronous DDP: it travels with the decision and is logged,
  nothing else.

:meth:`RankControl.state_dict` is what a checkpoint keeps (the controller's state, the decision
counts, the ratio in effect and a switch not yet applied), so a resumed run decides and switches as
the uninterrupted one would. :func:`config_problem` says what a run needs: evaluations to decide at,
and top-k compression for rho to mean anything.

    control = RankControl.for_run(config.system, rank, compression_ratio=...)
    control.step_done(step_time_s, exchange_s)       # after each step (counts on rank 0)
    decision = control.decide(eval_event, device)   # at each evaluation, on every rank
    switch = control.due(next_step)                 # before each step: set the hook's ratio
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from src.adaptive.controller import CompressionController
from src.adaptive.settings import ControllerSettings

ACTIONS = ("hold", "compress_less", "compress_more", "probe", "hold_for_persistence")
"""The controller's actions, by their index in the broadcast decision."""


def config_problem(config: Any) -> str | None:
    """Why a DDP run of ``config`` cannot use ``system.adaptive_compression`` (one line naming it), or ``None``."""
    system, training = config.system, config.training
    if not system.adaptive_compression:
        return None
    if not training.eval_interval:
        return (
            "system.adaptive_compression decides at evaluations: set training.eval_interval (steps between evaluations)"
        )
    if not system.compression_enabled or system.compression_type != "topk":
        return (
            "system.adaptive_compression sets top-k's Active Fraction: in DDP it needs system.compression_enabled: "
            "true with system.compression_type: topk"
        )
    return None


@dataclass(frozen=True)
class Switch:
    """A new top-k Active Fraction for every rank from step ``step`` on (1-based)."""

    step: int
    rho: float
    max_staleness: int


class RankControl:
    """One rank's side of the controller in DDP; see the module docstring.

    Args:
        controller: the deciding controller on rank 0, ``None`` on the other ranks.
        compression_ratio: the top-k ratio the rank's hook compresses with now.
        max_staleness: the latest decided S_max (logged and summarised only).
        pending: a switch decided but not yet applied (e.g. the controller's initial rho, clamped
            into its bounds, when it differs from ``compression_ratio``).
    """

    def __init__(
        self,
        controller: CompressionController | None,
        *,
        compression_ratio: float,
        max_staleness: int,
        pending: Switch | None = None,
    ):
        self.controller = controller
        self.compression_ratio = float(compression_ratio)
        self.max_staleness = int(max_staleness)
        self.pending = pending
        self.decisions: Counter[str] = Counter()
        """Decisions by action (the same on every rank: the action is broadcast too)."""

    @classmethod
    def for_run(
        cls, system: Any, rank: int, *, compression_ratio: float, saved: Mapping[str, Any] | None = None
    ) -> "RankControl":
        """The control of ``rank`` in a run whose hook starts at ``compression_ratio``; ``saved``: a checkpoint's
        :meth:`state_dict` to continue from."""
        settings = ControllerSettings.from_config(system)
        controller = CompressionController(settings) if rank == 0 else None
        if saved:
            if controller is not None:
                controller.load_state_dict(saved["state"])
            pending = saved.get("pending")
            control = cls(
                controller,
                compression_ratio=saved["compression_ratio"],
                max_staleness=saved["max_staleness"],
                pending=Switch(int(pending[0]), float(pending[1]), int(pending[2])) if pending else None,
            )
            control.decisions.update(saved["decisions"])
            return control
        start = None
        if settings.rho_initial != compression_ratio:  # compression_ratio outside the controller's bounds
            start = Switch(1, settings.rho_initial, settings.max_staleness_initial)
        return cls(
            controller, compression_ratio=compression_ratio, max_staleness=settings.max_staleness_initial, pending=start
        )

    # -- the run ---------------------------------------------------------------------------

    def step_done(self, step_time_s: float, exchange_s: float, payload_bytes: int = 0, dense_bytes: int = 0) -> None:
        """One training step's timing and the size of its payload and of the same gradients uncompressed (rank 0's
        controller sums them until the next evaluation)."""
        if self.controller is not None:
            self.controller.observe(
                {
                    "kind": "push",
                    "gradient_time_s": max(0.0, step_time_s - exchange_s),
                    "communication_time_s": max(0.0, exchange_s),
                    "payload_bytes": payload_bytes,
                    "dense_bytes": dense_bytes,
                }
            )

    def decide(self, eval_event: Mapping[str, Any] | None, device: torch.device) -> dict[str, Any] | None:
        """At an evaluation, on every rank (collective): rank 0 decides and broadcasts; returns rank 0's decision event.

        Args:
            eval_event: rank 0's ``eval`` event (``step``, ``test_loss``); ignored on other ranks.
            device: where the broadcast tensor lives (the rank's device under nccl, else CPU).
        """
        decision = None
        message = torch.zeros(4, dtype=torch.float64, device=device)
        if self.controller is not None:
            decision = self.controller.observe(eval_event)
            message = torch.tensor(
                [
                    decision["rho"],
                    decision["max_staleness"],
                    decision["apply_from_step"],
                    ACTIONS.index(decision["action"]),
                ],
                dtype=torch.float64,
                device=device,
            )
        dist.broadcast(message, src=0)
        rho, max_staleness, apply_from_step, action = message.tolist()
        self.receive(rho, int(max_staleness), int(apply_from_step), ACTIONS[int(action)])
        return decision

    def receive(self, rho: float, max_staleness: int, apply_from_step: int, action: str) -> None:
        """Take a decision (as every rank gets it from rank 0): a switch from ``apply_from_step`` when rho changes."""
        self.decisions[action] += 1
        self.max_staleness = max_staleness
        upcoming = self.pending.rho if self.pending is not None else self.compression_ratio
        if rho != upcoming:
            self.pending = Switch(apply_from_step, rho, max_staleness)

    def due(self, step: int) -> Switch | None:
        """The switch to make before step ``step`` (1-based), if one is due; it is then in effect."""
        switch = self.pending
        if switch is None or step < switch.step:
            return None
        self.pending = None
        if switch.rho == self.compression_ratio:
            return None
        self.compression_ratio = switch.rho
        return switch

    # -- summaries and checkpoints ---------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The run summary's ``controller`` entry (the parameter server's shape): the latest decided rho and S_max."""
        rho = self.pending.rho if self.pending is not None else self.compression_ratio
        return {
            "decisions": dict(self.decisions),
            "final_compression_ratio": rho,
            "final_max_staleness": self.max_staleness,
        }

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's state for a checkpoint's ``extra["controller"]`` (plain values)."""
        pending = self.pending
        return {
            "state": self.controller.state_dict() if self.controller is not None else None,
            "decisions": dict(self.decisions),
            "compression_ratio": self.compression_ratio,
            "max_staleness": self.max_staleness,
            "pending": [pending.step, pending.rho, pending.max_staleness] if pending is not None else None,
        }
