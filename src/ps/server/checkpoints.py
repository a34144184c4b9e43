"""The parameter server's checkpoints: what one holds, writing it, and reading one back to resume.

A checkpoint holds the parameters, the optimizer, the Server Version and, under ``extra``, everything
else a resumed server needs: work progress, de-dup outcomes, the workers to wait for, totals, the
controller and the model's layout (a server that takes its model from a worker rebuilds it from
that). Numbered checkpoints are written before the next update (lock held), the final one at the end.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

from src.common.checkpoint import (
    KEEP_CHECKPOINTS,
    CheckpointError,
    check_model_matches,
    load_latest_good,
    make_checkpoint,
    numbered_path,
    prune_checkpoints,
    save_checkpoint,
)
from src.config import Config
from src.coordinator import Membership
from src.metrics import MetricsLogger, read_events
from src.ps.server.control import ServerControl
from src.ps.server.totals import RunTotals
from src.ps.server.work_source import WorkSource
from src.ps.state.aggregation import RequestLog
from src.ps.state.model_sources import model_from_layout
from src.ps.state.refusals import RunFailed
from src.ps.state.served_model import ServedModel
from src.telemetry import tracing


def model_from_checkpoint(path: Path, checkpoint: dict[str, Any]) -> nn.Module:
    """The model a checkpoint of a server without its own model holds (built from its recorded layout)."""
    layout = checkpoint["extra"].get("layout")
    if layout is None:
        raise CheckpointError(f"--resume {path}: the checkpoint does not record its model's layout")
    state = checkpoint["model_state_dict"]
    return model_from_layout(
        [(n, tuple(state[n].shape)) for n in layout["parameters"]],
        [(n, tuple(state[n].shape)) for n in layout["buffers"]],
        [state[n] for n in layout["parameters"]],
        [state[n] for n in layout["buffers"]],
    )


class ServerCheckpoints:
    """Writes and reads this server's checkpoints of the run's parts (``model_label``/``data_label``: what
    they call the run's model and data); checkpoint and recovery events go to ``log``."""

    def __init__(
        self,
        config: Config,
        *,
        model_label: str,
        data_label: str,
        log: MetricsLogger,
        model: ServedModel,
        work: WorkSource,
        requests: RequestLog,
        members: Membership,
        totals: RunTotals,
        control: ServerControl,
    ):
        self.config = config
        self.model_label, self.data_label, self.log = model_label, data_label, log
        self.model, self.work, self.requests, self.members = model, work, requests, members
        self.totals, self.control = totals, control

    def capture(self) -> dict[str, Any]:
        """Everything a resumed server needs, copied (lock held)."""
        system = self.config.system
        state, work, members = self.model.state, self.work, self.members
        saved_totals = self.totals.state_dict()
        return {
            "model": state.snapshot(),
            "optimizer": copy.deepcopy(state.optimizer.state_dict()),
            "version": state.version,
            "epochs_done": work.epochs_done(),
            "extra": {
                "version": state.version,
                "aggregation_mode": system.aggregation_mode,
                "num_workers": system.num_workers,
                "work": work.state_dict(),
                "requests": self.requests.state_dict(),
                "next_incarnation": members.next_incarnation,
                # the workers a restarted server waits for (and fails, if they stay silent: a hang while it was down)
                "live_workers": [
                    [m.worker_id, m.incarnation, m.pid]
                    for m in members.current.values()
                    if m.state in ("live", "awaited")
                ],
                "counters": saved_totals.pop("counters"),
                "staleness_histogram": saved_totals.pop("staleness_histogram"),
                "controller": self.control.state_dict(),
                **saved_totals,
                "layout": {"parameters": list(state.param_names), "buffers": list(state.buffer_names)},
            },
        }

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Put what :meth:`capture` saved back into the run's parts (the workers it lists are awaited)."""
        extra, state, members = checkpoint["extra"], self.model.state, self.members
        state.model.load_state_dict(checkpoint["model_state_dict"])
        state.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        state.version = extra["version"]
        self.work.load_state_dict(extra["work"])
        self.requests.load_state_dict(extra["requests"])
        members.next_incarnation = extra["next_incarnation"]
        for worker_id, incarnation, pid in extra.get("live_workers", []):
            members.await_(worker_id, incarnation, pid)
        self.totals.load_state_dict(extra)
        self.control.load_state_dict(extra.get("controller"))

    def write(self, path: Path, state: dict[str, Any]) -> Path:
        """Write :meth:`capture`'s ``state`` to ``path`` (atomically)."""
        with tracing.span("checkpoint", version=state["version"]):
            checkpoint = make_checkpoint(
                model_state_dict=state["model"],
                optimizer_state_dict=state["optimizer"],
                model_architecture=self.model_label,
                dataset=self.data_label,
                epoch=state["epochs_done"],
                step=state["version"],
                config=self.config.to_dict(),
                extra=state["extra"],
            )
            return save_checkpoint(path, checkpoint)

    def write_numbered(self, version: int, state: dict[str, Any]) -> RunFailed | None:
        """Write ``checkpoint_<version>.pt`` and prune old ones; a failure is an event, returned as the error
        that ends the run."""
        try:
            directory = Path(self.config.system.checkpoint_dir)
            written = self.write(numbered_path(directory, version), state)
            prune_checkpoints(directory, KEEP_CHECKPOINTS)
            self.log.event("checkpoint", path=str(written), version=version)
        except Exception as exc:
            self.log.event("checkpoint_failed", version=version, error=f"{type(exc).__name__}: {exc}")
            return RunFailed(f"checkpoint at version {version} failed: {type(exc).__name__}: {exc}")
        return None

    def load(self, target: str | Path) -> tuple[Path, dict[str, Any]]:
        """The newest good checkpoint at ``target``, which must be one of this run's server (strictly)."""
        path, checkpoint = load_latest_good(target)
        extra = checkpoint["extra"]
        mode, num_workers = self.config.system.aggregation_mode, self.config.system.num_workers
        if "work" not in extra or extra.get("num_workers") != num_workers or extra.get("aggregation_mode") != mode:
            raise CheckpointError(
                f"--resume {path}: not a checkpoint of a {mode} parameter-server run with {num_workers} workers"
            )
        check_model_matches(path, checkpoint, self.model_label)
        return path, checkpoint

    def recovered(self, path: Path, version: int) -> None:
        """A server resumed from ``path`` at ``version``: count the recovery and the versions its predecessor
        reached past it (from the event log), and say so in the ``server_recovered`` event."""
        events_path = Path(self.config.system.log_dir) / "server" / "events.jsonl"
        reached = (
            max((e["version"] for e in read_events(events_path, "update")), default=version)
            if events_path.is_file()
            else version
        )
        self.totals.counters["server_recoveries"] += 1
        self.totals.counters["versions_lost"] += max(0, reached - version)
        self.log.event(
            "server_recovered", checkpoint=str(path), version=version, versions_lost=max(0, reached - version)
        )
