"""The cost model of a virtual-time run: how long each thing takes, from the config's ``emulation`` section.

Nothing is measured during a virtual run (:mod:`src.virtual.run`): every duration is computed
from these figures, so a run gives the same times on any machine under any load. The figures a
config lacks are measured once, on the machine to be modelled, by ``scripts/calibrate.py``, which
prints the ``emulation:`` lines to paste; a virtual run that lacks some measures them itself before it
starts (:func:`src.virtual.calibration.with_measured_figures`). This class refuses a config without them.

* **compute**: a step of worker k on ``n`` samples takes ``t = compute_s * n / batch_size``
  (``compute_s`` per worker in ``emulation.workers``), stretched as a real emulated run stretches
  it (:class:`src.emulation.netem.ComputeDelay`: ``slowdown * t + step_delay_s``, log-normal with
  ``step_delay_sigma``, seeded per worker). Plus ``compress_s`` per push for error feedback and
  compression when the run compresses.
* **links**: each message of ``n`` serialized bytes (the exact bytes a real run sends) crosses the
  worker's link at ``uplink_mbps`` / ``downlink_mbps`` and the server NIC at ``server_mbps``, which
  concurrent transfers share fairly (:class:`src.emulation.event_loop.SharedLink`), then waits the link's
  latency. ``uplink_schedule`` changes every uplink mid-run (:meth:`CostModel.uplink_bps`): a message
  crosses at the rate in force when it starts.
* **the server**: ``server_update_s`` per push it takes in, ``server_reply_s`` per reply it builds,
  one at a time (its lock).
* **server shards** (``system.num_servers`` = S > 1, :func:`shard_times`): each shard is a server of its own, with
  its own NIC of ``server_mbps`` each way and its own CPU; shard k's share of the work is its share of the model's
  bytes (``b_k / sum(b)``, from the placement), so it takes that share of ``server_update_s`` per held push and of
  ``server_reply_s`` per reply that carries its slices; a commit (no tensors) and its reply (no parameters) take
  none. Over a step the S shards together spend what one server spends, each on its own CPU.
* **faults**: a killed (or hung, then killed) process takes ``restart_s`` to start again.
* **streaming** (``system.streaming``): a step's compute seconds spread over the model's layers, each gradient's part on
  the worker's link as backward produces it, the next forward waiting per layer for the reply's tensors
  (:mod:`src.emulation.overlap`, :mod:`src.virtual.layers`).
* **DDP** (:func:`ring_allreduce_s`, :func:`all_gather_s`): the standard ring model,
  ``2(N-1)/N * bytes / bandwidth + 2(N-1) * latency`` for an all-reduce, ``(N-1) * payload /
  bandwidth + (N-1) * latency`` for an all-gather of one payload per rank.

What it does not model: contention for CPU cores (a real worker computing beside N others on two
cores is slower than its calibrated figure), OS jitter, and any transport overhead beyond what the
calibrated server times hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from src.config import Config, SetupError
from src.emulation.netem import BITS_PER_MEGABIT, ComputeDelay, WorkerConditions, conditions_for, worker_seed

CALIBRATE = "python scripts/calibrate.py --config CONFIG"
"""The command that measures the figures a virtual run needs (it prints them as emulation fields)."""


def _mbps_to_bps(mbps: float | None) -> float | None:
    return None if mbps is None else mbps * BITS_PER_MEGABIT


NEEDED_FOR = {
    "compute_s": "seconds per step",
    "compress_s": "the run compresses its gradients",
    "server_update_s": "the server's time per push",
    "server_reply_s": "the server's time per reply",
    "restart_s": "a faulted process restarts",
}
"""Each figure a virtual run may need, and why it needs it."""


def missing_figures(config: Config, *, server: bool = True) -> list[str]:
    """The ``emulation`` figures a virtual run of ``config`` needs and lacks (``server``: a parameter server's
    too), in :data:`NEEDED_FOR`'s order: ``compute_s`` when a worker has none, ``compress_s`` when the run
    compresses, the server's two, ``restart_s`` when it injects faults."""
    emulation, system = config.emulation, config.system
    needed = {
        "compute_s": _worker_without_compute(config) is not None,
        "compress_s": system.compression_enabled and emulation.compress_s is None,
        "server_update_s": server and emulation.server_update_s is None,
        "server_reply_s": server and emulation.server_reply_s is None,
        "restart_s": bool(system.inject_faults) and emulation.restart_s is None,
    }
    return [name for name in NEEDED_FOR if needed[name]]


def _worker_without_compute(config: Config) -> int | None:
    emulation = config.emulation
    return next((k for k in range(config.system.num_workers) if conditions_for(emulation, k).compute_s is None), None)


def _refuse_missing(config: Config, server: bool) -> None:
    """Raise a one-line error naming the first missing figure, why the run needs it, and the calibration command."""
    missing = missing_figures(config, server=server)
    if not missing:
        return
    name = field = missing[0]
    worker = _worker_without_compute(config)
    if name == "compute_s" and worker in config.emulation.workers:
        field = f"compute_s (or emulation.workers.{worker}.compute_s)"
    raise SetupError(
        f"emulation.{field}: a virtual-time run needs it ({NEEDED_FOR[name]}); measure it with `{CALIBRATE}`"
    )


@dataclass
class WorkerCosts:
    """One worker's figures (``conditions`` with ``emulation.workers`` overrides resolved)."""

    conditions: WorkerConditions
    compute_s: float
    delay: ComputeDelay

    @property
    def uplink_bps(self) -> float | None:
        return _mbps_to_bps(self.conditions.uplink_mbps)

    @property
    def downlink_bps(self) -> float | None:
        return _mbps_to_bps(self.conditions.downlink_mbps)

    @property
    def uplink_latency_s(self) -> float:
        return self.conditions.uplink_latency_ms / 1000.0

    @property
    def downlink_latency_s(self) -> float:
        return self.conditions.downlink_latency_ms / 1000.0


@dataclass(frozen=True)
class ServerTimes:
    """One server shard's seconds per held push (``update_s``) and per reply with its slices (``reply_s``)."""

    update_s: float
    reply_s: float


def shard_times(update_s: float, reply_s: float, bytes_per_shard: Sequence[int]) -> list[ServerTimes]:
    """Each shard's share of one server's ``update_s`` and ``reply_s``: its share of the model's bytes.

    Raises:
        ValueError: no shard holds any bytes.
    """
    total = sum(bytes_per_shard)
    if total <= 0:
        raise ValueError(f"bytes per shard {list(bytes_per_shard)}: the shards hold no bytes to share the work by")
    return [ServerTimes(update_s * b / total, reply_s * b / total) for b in bytes_per_shard]


class CostModel:
    """Every duration of a virtual run (see the module docstring).

    Args:
        config: the run's config; its ``emulation`` section holds the figures.
        server: whether a parameter server's figures are needed (``False`` for DDP).

    Raises:
        SetupError: a figure the run needs is missing (one line naming the field and the calibration command).
    """

    def __init__(self, config: Config, *, server: bool = True):
        _refuse_missing(config, server)
        emulation, system, t = config.emulation, config.system, config.training
        self.batch_size = t.batch_size
        self.workers: list[WorkerCosts] = []
        for k in range(system.num_workers):
            conditions = conditions_for(emulation, k)
            delay = ComputeDelay(conditions, worker_seed(t.seed, k))
            self.workers.append(WorkerCosts(conditions, conditions.compute_s, delay))
        self.compress_s = emulation.compress_s or 0.0
        self.server_update_s = emulation.server_update_s if server else 0.0
        self.server_reply_s = emulation.server_reply_s if server else 0.0
        self.server_bps = _mbps_to_bps(emulation.server_mbps)
        self.uplink_schedule = [(float(t), float(mbps)) for t, mbps in emulation.uplink_schedule]
        self.layer_split = [[float(f), float(b)] for f, b in emulation.layer_split]
        self.restart_s = emulation.restart_s or 0.0
        self.measured_here: dict[str, float] = {}
        """The figures the config lacked and this machine measured before the run
        (:func:`src.virtual.calibration.with_measured_figures`); the summary names them."""

    def uplink_bps(self, worker: int, now_s: float) -> float | None:
        """Worker ``worker``'s uplink bandwidth at virtual second ``now_s``: the latest ``uplink_schedule``
        entry at or before it, else its own ``uplink_mbps`` (``None``: not limited)."""
        scheduled = [mbps for t, mbps in self.uplink_schedule if t <= now_s]
        return _mbps_to_bps(scheduled[-1]) if scheduled else self.workers[worker].uplink_bps

    def step_s(self, worker: int, samples: int) -> tuple[float, float]:
        """Seconds of worker ``worker``'s forward/backward over ``samples`` samples (draws its delay), and the
        part of them that is emulated slowness (what a real run reports as ``emulated_delay_s``)."""
        costs = self.workers[worker]
        measured = costs.compute_s * samples / self.batch_size
        extra = costs.delay.extra_s(measured)
        return measured + extra, extra

    def push_compress_s(self, payload_bytes: int, dense_bytes: int) -> float:
        """What compressing a push of ``payload_bytes`` costs: ``compress_s``; a push sent uncompressed (as many bytes
        as its ``dense_bytes`` of identity payloads: its Active Fraction, as the controller's rho 1, or a warm-up
        step's, ``system.warmup_steps``) spends none, as a real worker's does not."""
        return self.compress_s if payload_bytes < dense_bytes else 0.0

    def shard_times(self, bytes_per_shard: Sequence[int]) -> list[ServerTimes]:
        """Each server shard's times (:func:`shard_times`) from ``server_update_s`` and ``server_reply_s``."""
        return shard_times(self.server_update_s, self.server_reply_s, bytes_per_shard)

    def describe(self, shards: Sequence[ServerTimes] = ()) -> dict[str, Any]:
        """The figures, for the run summary (``shards``: a sharded run's times per shard)."""
        return {
            "compute_s": {str(k): w.compute_s for k, w in enumerate(self.workers)},
            "compress_s": self.compress_s,
            "server_update_s": self.server_update_s,
            "server_reply_s": self.server_reply_s,
            "server_mbps": None if self.server_bps is None else self.server_bps / BITS_PER_MEGABIT,
            "restart_s": self.restart_s,
            **({"uplink_schedule": [list(entry) for entry in self.uplink_schedule]} if self.uplink_schedule else {}),
            **({"layer_split": self.layer_split} if self.layer_split else {}),
            **({"measured_here": sorted(self.measured_here)} if self.measured_here else {}),
            **(
                {"per_shard": {"update_s": [t.update_s for t in shards], "reply_s": [t.reply_s for t in shards]}}
                if shards
                else {}
            ),
        }


def ring_allreduce_s(world_size: int, num_bytes: int, bandwidth_bps: float | None, latency_s: float) -> float:
    """Seconds of a ring all-reduce of ``num_bytes``: ``2(N-1)/N * 8 bytes / bandwidth + 2(N-1) * latency``."""
    if world_size <= 1:
        return 0.0
    steps = 2 * (world_size - 1)
    transfer = steps / world_size * 8 * num_bytes / bandwidth_bps if bandwidth_bps else 0.0
    return transfer + steps * latency_s


def all_gather_s(world_size: int, payload_bytes: list[int], bandwidth_bps: float | None, latency_s: float) -> float:
    """Seconds of a ring all-gather of one payload per rank: each rank forwards the N-1 others' payloads."""
    if world_size <= 1:
        return 0.0
    largest_share = max(sum(payload_bytes) - b for b in payload_bytes)  # what the busiest rank receives
    transfer = 8 * largest_share / bandwidth_bps if bandwidth_bps else 0.0
    return transfer + (world_size - 1) * latency_s
