"""What a push costs at each Active Fraction, estimated from the pushes themselves: the link policy's model.

The adaptive controller's ``link`` policy (:mod:`src.adaptive.controller`) picks the top-k Active
Fraction rho, or no compression at all, whose step is fastest. This module holds the arithmetic, free
of I/O and clocks: it reads push events and predicts step times.

A worker's step is ``gradient + compression + communication``. The step less its compression is modelled as
a line in the payload's size, ``gradient + communication = fixed + bytes / throughput``: ``fixed`` is what
does not shrink with the payload (computing the gradient, the server's update and reply, queueing),
``bytes / throughput`` the upload. One payload size alone cannot split the two, so :class:`LinkModel` fits
the line through the means of two consecutive evaluation windows with different payload sizes (a probe: the
controller sends one window at another rho when it has no fit yet). A larger payload whose step took about
as long (the server, not the link, paces the steps: a worker waits for it whatever it sends) fits an
unlimited throughput; a smaller one that took much longer means the link changed between the windows, and
fits nothing. The fixed part is then kept, and the throughput re-estimated from every window's own pushes
(``bytes / (step less compression - fixed)``), so a link that slows down or speeds up moves the prediction
at the next evaluation without another probe.

Push events carry what the step cost (``gradient_time_s``, ``compression_time_s``) and the payload
whose exchange took ``communication_time_s`` (``payload_bytes``; the parameter server pairs each
worker's reported communication time with that worker's previous payload, the one it measured), and
the size of the same gradients uncompressed (``dense_bytes``). Top-k's payload is proportional to rho
(values and indices of the kept entries): ``bytes_per_rho`` is measured from a window spent at one rho.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

MIN_SIZE_RATIO = 1.25
"""Two windows' mean payloads must differ by this factor for a fit (closer: the line is noise)."""
PACED = 0.1
"""Steps within this fraction of each other at two payload sizes: the payload costs nothing measurable."""


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else None


@dataclass(frozen=True)
class WindowPoint:
    """One evaluation window's pushes: mean payload bytes against mean communication seconds, and the step's
    other parts."""

    payload_bytes: float
    communication_s: float
    gradient_s: float
    compression_s: float | None
    """Mean compression seconds of the compressed pushes (``None``: none compressed)."""
    dense_bytes: float | None
    pushes: int

    @property
    def uncompressed_s(self) -> float:
        """A step less its compression: what the line in the payload's size is fitted to."""
        return self.gradient_s + self.communication_s


class WindowSums:
    """Sums over the push events of one evaluation window."""

    def __init__(self) -> None:
        self.pushes = 0
        self.gradient_s = 0.0
        self.compression_s = 0.0
        self.compressed = 0
        self.paired = 0
        self.payload_bytes = 0.0
        self.communication_s = 0.0
        self.dense_bytes: float | None = None

    def add(self, event: Mapping[str, Any]) -> None:
        gradient = _finite(event.get("gradient_time_s"))
        if gradient is None:
            return
        self.pushes += 1
        self.gradient_s += gradient
        compression = _finite(event.get("compression_time_s"))
        if compression:
            self.compression_s += compression
            self.compressed += 1
        payload, communication = _finite(event.get("payload_bytes")), _finite(event.get("communication_time_s"))
        if payload and communication:
            self.paired += 1
            self.payload_bytes += payload
            self.communication_s += communication
        dense = _finite(event.get("dense_bytes"))
        if dense:
            self.dense_bytes = dense

    def point(self) -> WindowPoint | None:
        """The window's means (``None``: no push paired a payload with its communication time)."""
        if not self.paired:
            return None
        return WindowPoint(
            payload_bytes=self.payload_bytes / self.paired,
            communication_s=self.communication_s / self.paired,
            gradient_s=self.gradient_s / self.pushes,
            compression_s=self.compression_s / self.compressed if self.compressed else None,
            dense_bytes=self.dense_bytes,
            pushes=self.pushes,
        )

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


@dataclass
class LinkModel:
    """The fitted line and the last measured step parts; :meth:`update` at each evaluation, then :meth:`step_s`."""

    fixed_s: float | None = None
    """Step time (less compression) that does not shrink with the payload (``None``: no fit yet)."""
    throughput: float | None = None
    """Bytes per second of the payload part, from the latest window."""
    gradient_s: float | None = None
    compression_s: float | None = None
    dense_bytes: float | None = None
    bytes_per_rho: float | None = None
    """Top-k payload bytes per unit of rho (measured from a window at one rho)."""
    previous: WindowPoint | None = None

    def update(self, point: WindowPoint, rho: float | None) -> None:
        """Take a window's point; ``rho``: the one Active Fraction all its payloads were made at (``None``: mixed or
        uncompressed)."""
        before = self.previous
        if before is not None and _differ(before.payload_bytes, point.payload_bytes):
            slope = (point.uncompressed_s - before.uncompressed_s) / (point.payload_bytes - before.payload_bytes)
            if slope > 0:
                self.fixed_s = min(max(point.uncompressed_s - slope * point.payload_bytes, 0.0), point.uncompressed_s)
            elif _close(before.uncompressed_s, point.uncompressed_s):
                # the larger payload cost no more: the server, not the link, paces the steps
                self.fixed_s = point.uncompressed_s
            # else the smaller payload took much longer: the link changed between the windows, no fit from them
        self.previous = point
        self.gradient_s = point.gradient_s
        if point.compression_s is not None:
            self.compression_s = point.compression_s
        if point.dense_bytes is not None:
            self.dense_bytes = point.dense_bytes
        if rho is not None and rho < 1:
            self.bytes_per_rho = point.payload_bytes / rho
        if self.fixed_s is not None:
            transfer = point.uncompressed_s - self.fixed_s
            self.throughput = point.payload_bytes / transfer if transfer > 0 else math.inf

    @property
    def fitted(self) -> bool:
        return self.fixed_s is not None and self.throughput is not None

    def payload_bytes(self, rho: float) -> float | None:
        """Predicted payload at ``rho`` (1: uncompressed)."""
        if rho >= 1:
            return self.dense_bytes
        return None if self.bytes_per_rho is None else rho * self.bytes_per_rho

    def step_s(self, rho: float) -> float | None:
        """Predicted seconds of a step at ``rho`` (1: uncompressed, no compression time), or ``None`` when the
        model lacks what it needs."""
        payload = self.payload_bytes(rho)
        if not self.fitted or payload is None or self.gradient_s is None:
            return None
        # no compression time reported (DDP: it is inside the exchange's time): none predicted
        compression = 0.0 if rho >= 1 else (self.compression_s or 0.0)
        return self.fixed_s + payload / self.throughput + compression

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in vars(self).items() if k != "previous"}
        state["previous"] = None if self.previous is None else dict(vars(self.previous))
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "LinkModel":
        previous = state.get("previous")
        return cls(**{**state, "previous": WindowPoint(**previous) if previous else None})


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= PACED * max(a, b)


def _differ(a: float, b: float) -> bool:
    low, high = sorted((a, b))
    return low > 0 and high / low >= MIN_SIZE_RATIO
