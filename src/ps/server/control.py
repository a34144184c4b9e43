"""What the server tells workers to do next: the Control of every reply, and the async staleness policy.

With ``system.adaptive_compression`` the :class:`~src.adaptive.controller.CompressionController` is fed the
server's push events (timings) and decides at evaluations; its decisions set the top-k ratio the
workers use from their next step and the policy's S_max that pushes are judged against.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from src import parameter_server_pb2 as pb
from src.adaptive.controller import CompressionController
from src.config import Config
from src.metrics import MetricsLogger
from src.ps.state.staleness import StalenessPolicy


class ServerControl:
    """The current Control message and staleness policy, and the controller that changes them (if any)."""

    def __init__(self, config: Config, staleness_policy: StalenessPolicy | None):
        system = config.system
        self.compresses_topk = system.compression_enabled and system.compression_type == "topk"
        self.staleness_policy = staleness_policy or StalenessPolicy.from_config(system)
        self.controller = CompressionController.from_config(system) if system.adaptive_compression else None
        self.decisions: Counter[str] = Counter()  # by action: hold / compress_less / compress_more / probe
        self._last_payload: dict[int, int] = {}
        """Each worker's latest payload bytes: its next push reports how long that one took to exchange. Not in
        checkpoints on purpose: after a server restarts, a worker's first push reports an exchange with the old
        process (cut off, or retried), so with no paired size its time stays out of the controller's fit."""
        self.control = pb.Control()
        if self.controller is not None:
            self._set(self.controller.rho, self.controller.max_staleness)

    def observe_push(self, event: dict[str, Any], payload_bytes: int, dense_bytes: int) -> None:
        """A push event and its payload's size: the controller takes its timings (decisions come at evaluations).

        A push reports the communication time of the worker's previous push (it is measured when that reply is in),
        so the controller is handed that push's payload bytes with it."""
        if self.controller is not None:
            worker = event.get("worker")
            measured = self._last_payload.get(worker, 0) if event.get("communication_time_s") else 0
            self._last_payload[worker] = payload_bytes
            self.controller.observe({**event, "payload_bytes": measured, "dense_bytes": dense_bytes})

    def decide(self, eval_event: dict[str, Any], log: MetricsLogger) -> None:
        """The controller's decision at an evaluation: an event, and the Control of every later reply (lock held)."""
        decision = self.controller.observe(eval_event)
        if decision is None:
            return
        fields = {k: v for k, v in decision.items() if k != "kind"}
        log.event("controller", **fields)
        self.decisions[decision["action"]] += 1
        self._set(decision["rho"], decision["max_staleness"])

    def _set(self, rho: float, max_staleness: int) -> None:
        """Workers use ``rho`` from their next step (top-k runs); pushes are judged against ``max_staleness`` now."""
        self.control = pb.Control(compression_ratio=rho if self.compresses_topk else 0.0, max_staleness=max_staleness)
        self.staleness_policy = self.staleness_policy.with_max_staleness(max_staleness)

    def state_dict(self) -> dict[str, Any] | None:
        """The controller's state and decision counts, for a checkpoint (``None``: no controller)."""
        if self.controller is None:
            return None
        return {"state": self.controller.state_dict(), "decisions": dict(self.decisions)}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Continue from :meth:`state_dict` (a checkpoint without a controller's state changes nothing)."""
        if self.controller is not None and saved:
            self.controller.load_state_dict(saved["state"])
            self.decisions.update(saved["decisions"])
            self._set(self.controller.rho, self.controller.max_staleness)

    def summary(self) -> dict[str, Any] | None:
        """The run summary's ``controller`` field."""
        if self.controller is None:
            return None
        return {
            "decisions": dict(self.decisions),
            "final_compression_ratio": self.control.compression_ratio or None,
            "final_max_staleness": self.controller.max_staleness,
        }
