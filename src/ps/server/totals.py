"""The parameter server's running totals and the run summary made from them.

Counters (pushes applied / rejected / refused, samples applied, workers failed, recoveries, ...),
the staleness histogram, each worker incarnation's reported stats, the training clock and the
time to the target accuracy: checkpointed with the run, and turned into ``summary.json`` at its end.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from src import parameter_server_pb2 as pb
from src.common.clock import Clock
from src.config import Config
from src.coordinator import Member
from src.emulation import netem
from src.metrics import TimeToTarget
from src.telemetry.exposed_comm import exposed_communication

TRAINING_CLOCK = "from the first work handed to a worker to the last update applied; includes server restarts"
"""What the summary's ``train_time_s`` measures."""


def compression_label(config: Config) -> str:
    """How gradients travel, for summaries: ``none``, ``topk(0.1)``, ``quantization(8)``."""
    system = config.system
    if not system.compression_enabled:
        return "none"
    if system.compression_type == "topk":
        return f"topk({system.compression_ratio:g})"
    return f"quantization({system.quantization_bits})"


def emulation_summary(config: Config, downlink_delay_s: dict[int, float] | None) -> dict[str, Any] | None:
    """Which emulation was on (``None``: none) and the downlink delay each worker's replies waited."""
    described = netem.describe(config.emulation, config.system.num_workers)
    if described is not None and downlink_delay_s:
        described["downlink_delay_s"] = {str(k): v for k, v in downlink_delay_s.items()}
    return described


class RunTotals:
    """What the run has done so far, on the injected clock (see the module docstring)."""

    def __init__(self, clock: Clock, target_accuracy: float | None):
        self.clock = clock
        self.counters = Counter()  # pushes_applied / _rejected / _refused, samples_applied, workers_failed, ...
        self.staleness_histogram: Counter[int] = Counter()
        self.stats_by_incarnation: dict[int, dict[str, Any]] = {}
        self.run_started = clock.time()
        self.train_started: float | None = None
        self.train_ended: float | None = None
        self.target = TimeToTarget(target_accuracy)

    def record_stats(self, member: Member, stats: pb.WorkerStats, *, final: bool) -> dict[str, Any]:
        """Keep ``member``'s reported totals (its latest report wins); returns them as a dict."""
        values = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
        self.stats_by_incarnation[member.incarnation] = {
            "worker_id": member.worker_id,
            "incarnation": member.incarnation,
            "final": final,
            **values,
        }
        return values

    def training_clock_starts(self) -> None:
        """The first work is handed out: the training clock starts (once)."""
        if self.train_started is None:
            self.train_started = self.clock.time()

    def training_clock_stops(self) -> None:
        """The last update is applied: the training clock stops (once)."""
        if self.train_ended is None:
            self.train_ended = self.clock.time()

    def elapsed(self) -> float:
        """Seconds on the training clock: from the first work handed out (0 before)."""
        return self.clock.time() - self.train_started if self.train_started is not None else 0.0

    def train_time(self) -> float:
        """Seconds on the training clock, up to its stop if it stopped."""
        return self.elapsed() if self.train_ended is None else self.train_ended - (self.train_started or 0.0)

    def workers(self) -> list[dict[str, Any]]:
        """Every incarnation's stats with its exposed communication, in incarnation order (lock held)."""
        return [exposed_communication(self.stats_by_incarnation[i]) for i in sorted(self.stats_by_incarnation)]

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's fields for the totals (they sit in its ``extra``)."""
        return {
            "counters": dict(self.counters),
            "staleness_histogram": {str(k): v for k, v in self.staleness_histogram.items()},
            "stats_by_incarnation": {str(k): dict(v) for k, v in self.stats_by_incarnation.items()},
            "run_started_wall": self.run_started,
            "train_started_wall": self.train_started,
            "time_to_target": [self.target.seconds, self.target.step],
        }

    def load_state_dict(self, extra: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``extra`` (:meth:`state_dict`'s fields)."""
        self.counters.update(extra["counters"])
        self.staleness_histogram.update({int(k): v for k, v in extra["staleness_histogram"].items()})
        self.stats_by_incarnation = {int(k): v for k, v in extra["stats_by_incarnation"].items()}
        self.run_started = extra["run_started_wall"]
        self.train_started = extra["train_started_wall"]
        self.target.seconds, self.target.step = extra["time_to_target"]

    def summary(
        self,
        config: Config,
        *,
        data_label: str,
        final_loss: float,
        final_accuracy: float,
        checkpoint_path: str,
        versions: int,
        train_time: float,
        workers: list[dict[str, Any]],
        controller: dict[str, Any] | None,
        emulation: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The run summary (``workers``: :meth:`workers`, taken under the lock with the final checkpoint's state;
        ``train_time``: :meth:`train_time` when the run ended, as its final evaluation recorded it)."""
        samples = self.counters["samples_applied"]
        histogram = dict(sorted(self.staleness_histogram.items()))
        judged = sum(histogram.values())
        return {
            "architecture": "parameter_server",
            "dataset": data_label,
            "num_workers": config.system.num_workers,
            "aggregation_mode": config.system.aggregation_mode,
            "final_accuracy": final_accuracy,
            "final_loss": final_loss,
            "total_time_s": self.clock.time() - self.run_started,
            "train_time_s": train_time,
            "clock": self.clock.kind,
            "training_clock": TRAINING_CLOCK,
            "throughput_samples_per_s": samples / train_time if train_time > 0 else 0.0,
            "samples_processed": samples,
            "samples_computed": sum(w["samples"] for w in workers),
            "bytes_sent": sum(w["bytes_sent"] for w in workers),
            "bytes_received": sum(w["bytes_received"] for w in workers),
            "compression": compression_label(config),
            "checkpoint_path": checkpoint_path,
            "epochs": config.training.num_epochs,
            "versions": versions,
            "pushes_applied": self.counters["pushes_applied"],
            "pushes_rejected": self.counters["pushes_rejected"],
            "pushes_refused": self.counters["pushes_refused"],
            "staleness_histogram": {str(k): v for k, v in histogram.items()},
            "mean_staleness": sum(k * v for k, v in histogram.items()) / judged if judged else 0.0,
            "max_staleness": max(histogram, default=0),
            "controller": controller,
            **self.target.fields(),
            "gradient_time_s": sum(w["gradient_time_s"] for w in workers),
            "compression_time_s": sum(w["compression_time_s"] for w in workers),
            "communication_time_s": sum(w["communication_time_s"] for w in workers),
            "exposed_communication_s": sum(w["exposed_communication_s"] for w in workers),
            "faults": {
                "worker_failures": self.counters["workers_failed"],
                "server_recoveries": self.counters["server_recoveries"],
                "versions_lost": self.counters["versions_lost"],
            },
            "worker_incarnations": len(workers),
            "workers": workers,
            "emulation": emulation,
        }
