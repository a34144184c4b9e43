"""Emulated stragglers and slow links, so two cores can stand in for a heterogeneous cluster.

Configured by the ``emulation`` section of a run's config (:class:`src.config.EmulationConfig`):
values for every worker, overridden per worker id under ``emulation.workers``::

    emulation:
      uplink_mbps: 250            # every worker's uplink: 250 Mbit/s
      workers:
        1: {slowdown: 4}          # worker 1 computes 4x slower

What is emulated, and where (all of it is real waiting, ``time.sleep``, so emulated time is wall
time and shows in every timing, summary and plot):

* **Compute heterogeneity** (:class:`ComputeDelay`, in the worker after each step's forward/backward):
  the step's measured compute time ``t`` is stretched to ``slowdown * t``, plus ``step_delay_s``
  (a fixed delay, or with ``step_delay_sigma`` > 0 a seeded log-normal one whose median is
  ``step_delay_s``). The wait counts as gradient time.
* **Links** (:class:`Link`): a message of ``n`` serialized bytes waits ``8 n / bandwidth + latency``
  before it goes out, in its sender: the worker's client for the uplink (every message it sends once
  registration has told it its conditions),
  the server's reply path for the downlink (the Pull and Push replies, which carry the model). The
  bytes are the exact serialized gRPC message, the same ones the byte counters count. Messages do
  not queue behind each other on a link: a worker sends one push at a time, and the only message
  that can overlap it (a ~100-byte heartbeat) shares a real connection's bandwidth frame by frame.

The workers report the delay they waited (compute + uplink) as ``emulated_delay_s``, the server
the downlink delay per worker, and the run summary says which emulation was on (:func:`describe`).
Check against the real thing: ``tests/test_netem.py`` runs the same bandwidth-limited run with the
links shaped by ``tc`` in network namespaces and compares wall times.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from src.common.seeds import DELAY_STREAM, derive_seed
from src.config import EmulationConfig, SetupError

BITS_PER_MEGABIT = 1_000_000


@dataclass(frozen=True)
class WorkerConditions:
    """One worker's emulated conditions, with ``emulation.workers`` overrides resolved."""

    slowdown: float = 1.0
    step_delay_s: float = 0.0
    step_delay_sigma: float = 0.0
    uplink_mbps: float | None = None
    downlink_mbps: float | None = None
    uplink_latency_ms: float = 0.0
    downlink_latency_ms: float = 0.0
    compute_s: float | None = None
    """A virtual-time run's compute seconds per batch (:mod:`src.virtual.run`); real runs measure it."""

    @property
    def active(self) -> bool:
        return self != WorkerConditions()

    @property
    def uplink(self) -> "LinkSpec | None":
        return LinkSpec.of(self.uplink_mbps, self.uplink_latency_ms)

    @property
    def downlink(self) -> "LinkSpec | None":
        return LinkSpec.of(self.downlink_mbps, self.downlink_latency_ms)


def conditions_for(emulation: EmulationConfig, worker_id: int) -> WorkerConditions:
    """Worker ``worker_id``'s conditions: ``emulation``'s values, overridden by ``emulation.workers[worker_id]``."""
    values = {name: getattr(emulation, name) for name in WorkerConditions.__dataclass_fields__}
    override = emulation.workers.get(worker_id)
    if override is not None:
        values.update({name: value for name, value in override.model_dump().items() if value is not None})
    return WorkerConditions(**values)


def check_workers(emulation: EmulationConfig, num_workers: int) -> None:
    """Raise :class:`SetupError` if ``emulation.workers`` names a worker id the run does not have."""
    unknown = sorted(k for k in emulation.workers if not 0 <= k < num_workers)
    if unknown:
        raise SetupError(
            f"emulation.workers: worker ids {unknown} are not workers of this run "
            f"(system.num_workers={num_workers}: ids 0..{num_workers - 1})"
        )


def describe(emulation: EmulationConfig, num_workers: int) -> dict[str, Any] | None:
    """What the run summary says about emulation: ``None`` when off, else each emulated worker's conditions."""
    workers = {str(k): conditions_for(emulation, k) for k in range(num_workers)}
    active = {
        k: {name: value for name, value in asdict(c).items() if value != getattr(WorkerConditions(), name)}
        for k, c in workers.items()
        if c.active
    }
    return {"workers": active} if active else None


# ----------------------------------------------------------------------------- links


@dataclass(frozen=True)
class LinkSpec:
    """A link's bandwidth (Mbit/s; ``None`` = not limited) and one-way latency (ms)."""

    bandwidth_mbps: float | None
    latency_ms: float = 0.0

    @staticmethod
    def of(bandwidth_mbps: float | None, latency_ms: float) -> "LinkSpec | None":
        """The link, or ``None`` when it neither limits bandwidth nor adds latency."""
        if bandwidth_mbps is None and not latency_ms:
            return None
        return LinkSpec(bandwidth_mbps, latency_ms)

    def transfer_s(self, num_bytes: int) -> float:
        """Seconds a message of ``num_bytes`` takes on this link: ``8 n / bandwidth + latency``."""
        serialization = 8 * num_bytes / (self.bandwidth_mbps * BITS_PER_MEGABIT) if self.bandwidth_mbps else 0.0
        return serialization + self.latency_ms / 1000.0


class Link:
    """The sender's end of an emulated link: :meth:`transmit` waits out each message's transfer time.

    Args:
        spec: the link's bandwidth and latency.
        sleep: how to wait (tests inject a recorder).

    ``delay_s`` (total seconds waited) and ``messages`` are safe to read from another thread.
    """

    def __init__(self, spec: LinkSpec, *, sleep: Callable[[float], None] = time.sleep):
        self.spec = spec
        self._sleep = sleep
        self._lock = threading.Lock()
        self.delay_s = 0.0
        self.messages = 0
        self.bytes = 0

    def transmit(self, num_bytes: int) -> float:
        """Wait as long as ``num_bytes`` take on the link (call it before sending them); returns the seconds."""
        delay = self.spec.transfer_s(num_bytes)
        with self._lock:
            self.delay_s += delay
            self.messages += 1
            self.bytes += num_bytes
        if delay > 0:
            self._sleep(delay)
        return delay


def link_or_none(spec: LinkSpec | None, **kwargs: Any) -> Link | None:
    return Link(spec, **kwargs) if spec is not None else None


# ----------------------------------------------------------------------------- compute


class ComputeDelay:
    """How much longer a worker's step takes than its measured compute: ``(slowdown - 1) t + delay``.

    Args:
        conditions: the worker's ``slowdown``, ``step_delay_s`` and ``step_delay_sigma``.
        seed: seeds the log-normal delays (the same seed gives the same sequence of delays).
        sleep: how to wait (tests inject a recorder).
    """

    def __init__(self, conditions: WorkerConditions, seed: int, *, sleep: Callable[[float], None] = time.sleep):
        self.slowdown = conditions.slowdown
        self.step_delay_s = conditions.step_delay_s
        self.sigma = conditions.step_delay_sigma
        self._random = random.Random(seed)
        self._sleep = sleep
        self.delay_s = 0.0

    @property
    def active(self) -> bool:
        return self.slowdown != 1.0 or self.step_delay_s > 0

    def extra_s(self, compute_s: float) -> float:
        """The added seconds for a step whose compute took ``compute_s`` (draws the step's delay)."""
        delay = self.step_delay_s
        if delay > 0 and self.sigma > 0:
            delay *= math.exp(self._random.gauss(0.0, self.sigma))  # log-normal with median step_delay_s
        return (self.slowdown - 1.0) * max(compute_s, 0.0) + delay

    def after_step(self, compute_s: float) -> float:
        """Wait out the emulated part of a step whose compute took ``compute_s``; returns the seconds waited."""
        extra = self.extra_s(compute_s)
        if extra > 0:
            self._sleep(extra)
            self.delay_s += extra
        return extra


def worker_seed(training_seed: int, worker_id: int) -> int:
    """The seed of worker ``worker_id``'s delays: distinct per worker, fixed by the run's seed."""
    return derive_seed(training_seed, worker_id, DELAY_STREAM)
