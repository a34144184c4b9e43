"""The workers' lifecycle as the parameter server sees it: register, report, finish, fail.

A worker registers (a new incarnation, with a session secret every later call must carry; one that
replaces a live incarnation fails it), reports its totals with heartbeats, and leaves with Finish.
A worker silent for ``system.heartbeat_timeout``, or replaced, is failed: it leaves the sync
barrier with its not-yet-applied contribution and the work it held goes to the live workers.
Who is a live member is :class:`~src.coordinator.Membership`'s; this adds what the run does about it.
Everything here runs with the core's lock held.

The registration reply carries the run's config, less the server's own paths (:data:`SERVER_PATHS`, sent at their
defaults): a worker keeps its own, and a message's size must not depend on where the server's folders are.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from src import parameter_server_pb2 as pb
from src.config import Config
from src.coordinator import Member, Membership, MembershipError
from src.metrics import MetricsLogger
from src.ps.server.totals import RunTotals
from src.ps.server.updates import Updates
from src.ps.server.work_source import WorkSource
from src.ps.state.aggregation import RequestLog
from src.ps.state.refusals import MEMBERSHIP_CODES
from src.ps.state.served_model import ServedModel
from src.transport.errors import Refused

SERVER_PATHS = (
    "training.data_dir",
    "system.log_dir",
    "system.checkpoint_dir",
    "system.tls_cert_file",
    "system.tls_key_file",
    "system.tls_ca_file",
)
"""The server's files and folders: meaningless to a worker on another host, so not sent (see the module docstring).
A worker's own are among the fields it keeps (:data:`src.ps.worker.run_config.LOCAL_FIELDS`)."""

SERVER_ONLY = (
    "system.controller_policy",
    "system.controller_step_slack",
    "system.controller_critical_drop",
    "system.controller_critical_slack",
    "system.pipeline_slice_bytes",
)
"""Settings only the server reads, left out of the reply: a worker's config takes their defaults. The controller's
(a worker follows the Control of its replies) and the slices' size (a worker takes provisional slices whenever they
come: :mod:`src.ps.state.slice_pipeline`). Older server-only settings are still sent, as they were when the findings'
records were made (leaving them out would change every registration reply's size, so every record)."""

SENT_WHEN_ON = ("system.pipelined_replies",)
"""Switches the reply carries only when they are on (off, a worker's config reads their default, off):
``pipelined_replies`` tells a streaming gRPC worker to send a large part in pieces, which only a pipelining server
reads as they come (:data:`src.transport.grpc.PART_PIECE_BYTES`). A run without them sends what it sent before
they existed, byte for byte."""


def config_for_workers(config: Config) -> str:
    """The run's config as the registration reply carries it: JSON, with :data:`SERVER_PATHS` at their defaults,
    without :data:`SERVER_ONLY`, and with :data:`SENT_WHEN_ON` only when on."""
    defaults: dict[str, dict[str, object]] = {}
    for dotted in SERVER_PATHS:
        section, field = dotted.split(".")
        defaults.setdefault(section, {})[field] = type(getattr(config, section)).model_fields[field].default
    sections = {name: getattr(config, name).model_copy(update=fields) for name, fields in defaults.items()}
    left_out: dict[str, set[str]] = {}
    for dotted in SERVER_ONLY + SENT_WHEN_ON:
        section, field = dotted.split(".")
        if dotted in SENT_WHEN_ON and getattr(getattr(config, section), field):
            continue  # on: sent
        left_out.setdefault(section, set()).add(field)
    return config.model_copy(update=sections).model_dump_json(exclude=left_out)


class Workers:
    """Registers, finishes and fails the run's workers (see the module docstring).

    Args:
        lock: the core's lock (waiting calls are woken when a worker comes or goes).
        check_done: called when a worker leaving may have ended the run.
    """

    def __init__(
        self,
        config: Config,
        *,
        members: Membership,
        model: ServedModel,
        work: WorkSource,
        requests: RequestLog,
        updates: Updates,
        totals: RunTotals,
        log: MetricsLogger,
        lock: threading.Condition,
        check_done: Callable[[], None],
    ):
        self.config = config
        self.num_workers = config.system.num_workers
        self.members, self.model, self.work, self.requests = members, model, work, requests
        self.updates, self.totals, self.log, self.lock = updates, totals, log, lock
        self._check_done = check_done

    def member(self, caller: pb.Caller) -> Member:
        """The live member behind ``caller``, marked as seen; refuses the call otherwise."""
        try:
            return self.members.check(caller.worker_id, caller.session)
        except MembershipError as exc:
            raise Refused(MEMBERSHIP_CODES[exc.kind], exc.message) from None

    def register(self, request: pb.RegisterRequest, peer: str) -> tuple[pb.RegisterReply, list]:
        """A new incarnation of a worker id; returns the reply and the events to publish (a replaced incarnation)."""
        worker_id = self._free_worker_id() if request.any_worker_id else request.worker_id
        try:
            member, replaced = self.members.register(worker_id, request.pid)
        except ValueError as exc:
            raise Refused("INVALID_ARGUMENT", str(exc)) from None
        # Every incarnation is in the summary's workers, also one killed before its first heartbeat.
        self.totals.record_stats(member, pb.WorkerStats(), final=False)
        events = []
        if replaced is not None:
            events += self.fail(replaced, reason="replaced by a new incarnation", silence=None)
        self.model.downlink.forget(worker_id)
        applied = bool(request.last_request_id) and self.requests.was_applied(worker_id, request.last_request_id)
        unknown = self.work.claim(worker_id, request.carried_batch_ids) if not applied else []
        self.lock.notify_all()
        rejoined = any(m.worker_id == worker_id for m in self.members.history[:-1])
        self.log.event(
            "worker_rejoined" if rejoined else "register",
            worker=worker_id,
            incarnation=member.incarnation,
            peer=peer,
            pid=request.pid,
            version=self.model.version,
            last_request_applied=applied,
            carried_batches=list(request.carried_batch_ids),
            carried_unknown=unknown,
        )
        if rejoined:  # a launcher waiting for a process it saw declared failed learns it came back
            events.append(
                ("worker_rejoined", {"worker": worker_id, "incarnation": member.incarnation, "pid": request.pid})
            )
        reply = pb.RegisterReply(
            worker_id=worker_id,
            incarnation=member.incarnation,
            session=member.session,
            version=self.model.version,
            run_config_json=config_for_workers(self.config),
            parameter_specs=self.model.param_specs,
            buffer_specs=self.model.buffer_specs,
            last_request_applied=applied,
            model_wanted=self.model.state is None,
        )
        return reply, events

    def _free_worker_id(self) -> int:
        """The lowest worker id no live incarnation holds; refuses when all are held."""
        live = set(self.members.live())
        free = [w for w in range(self.num_workers) if w not in live]
        if not free:
            raise Refused(
                "RESOURCE_EXHAUSTED", f"all {self.num_workers} worker ids are held by live workers (system.num_workers)"
            )
        return free[0]

    def finish(self, caller: pb.Caller, stats: pb.WorkerStats) -> pb.FinishReply:
        """A worker leaves (planned work: only once the run is finished) with its totals for the summary."""
        member = self.member(caller)
        refusal = self.work.finish_refused()
        if refusal is not None:
            raise Refused("FAILED_PRECONDITION", f"worker {member.worker_id}: {refusal}")
        values = self.totals.record_stats(member, stats, final=True)
        self.members.finish(member)
        if self.model.state is not None:
            self.model.state.forget_worker(member.worker_id)
        if self.updates.forget(member.worker_id):
            self.updates.maybe_complete_round()
        self.updates.maybe_start()  # a sync run waiting for everyone may now start without it
        self._check_done()
        self.lock.notify_all()
        self.log.event(
            "worker_finished",
            worker=member.worker_id,
            incarnation=member.incarnation,
            version=self.model.version,
            **values,
        )
        return pb.FinishReply(version=self.model.version)

    def expire(self) -> list:
        """Fail every worker silent for longer than ``heartbeat_timeout``; returns the events to publish."""
        events = []
        awaited = set(self.members.awaited())
        for member, silence in self.members.expire():
            reason = (
                f"did not register with the restarted server within {silence:.2f} s"
                if member.worker_id in awaited
                else f"silent for {silence:.2f} s"
            )
            events += self.fail(member, reason=reason, silence=silence)
        return events

    def fail(self, member: Member, *, reason: str, silence: float | None) -> list[tuple[str, dict[str, Any]]]:
        """``member`` is gone: leave the barrier, hand its work to the live workers. Returns events to publish."""
        self.members.fail(member)
        worker = member.worker_id
        self.totals.counters["workers_failed"] += 1
        self.updates.forget(worker)
        if self.model.state is not None:
            self.model.state.forget_worker(worker)
        moved = self.work.release(worker, self.members.live())
        version = self.model.version
        self.log.event(
            "worker_failed",
            worker=worker,
            incarnation=member.incarnation,
            pid=member.pid,
            reason=reason,
            silent_for_s=silence,
            version=version,
        )
        if moved:
            self.log.event(
                "work_reassigned",
                worker=worker,
                version=version,
                batches={str(to): [b.batch_id for b in bs] for to, bs in moved.items()},
                samples=sum(len(b.indices) for bs in moved.values() for b in bs),
            )
        if self.updates.mode == "sync" and self.model.state is not None:
            self.updates.maybe_start()
            self.updates.maybe_complete_round()
        self._check_done()
        self.lock.notify_all()
        return [("worker_failed", {"worker": worker, "incarnation": member.incarnation, "pid": member.pid})]

    def status(self, *, done: bool) -> pb.StatusReply:
        """The Status reply: who registered and finished, every incarnation's state, the totals so far."""
        current, counters = self.members.current, self.totals.counters
        return pb.StatusReply(
            version=self.model.version,
            aggregation_mode=self.config.system.aggregation_mode,
            num_workers=self.num_workers,
            registered=sorted(w for w, m in current.items() if m.state != "awaited"),
            finished=sorted(w for w, m in current.items() if m.state == "finished"),
            pushes_applied=counters["pushes_applied"],
            pushes_rejected=counters["pushes_rejected"],
            pushes_refused=counters["pushes_refused"],
            done=done,
            workers=[
                pb.WorkerState(worker_id=m.worker_id, incarnation=m.incarnation, state=m.state)
                for m in self.members.history
            ],
            epochs_done=self.work.epochs_done(),
        )
