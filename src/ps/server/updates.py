"""How admitted pushes become optimizer steps: the sync barrier, the async staleness verdict, each step's rate.

* **sync**: one barrier per version among the workers handed work for it (:class:`src.ps.state.aggregation.SyncRound`);
  the sample-weighted mean of their gradients is one optimizer step. The first round starts when all
  ``num_workers`` workers are ready.
* **async**: each push is judged by the staleness policy (weight, or reject) and applied at once.

The update that makes version ``v + 1`` steps at ``training.lr_schedule``'s rate for ``v``, unless its
pushes carry their own scheduler's rate (then that one, the mean over a sync round's pushes). An
applied update is bookkept here (de-dup outcome, work progress, totals, the ``update`` event); what
follows it (checkpoints, evaluations, faults, the end of the run) is the owner's ``on_update``.
Everything here runs with the core's lock held.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from src import parameter_server_pb2 as pb
from src.config import Config
from src.coordinator import Batch, Member, Membership
from src.metrics import MetricsLogger
from src.ps.server.control import ServerControl
from src.ps.server.totals import RunTotals
from src.ps.server.work_source import WorkSource
from src.ps.shards.asynchronous import FORGET, ROLLED_BACK_HERE, WINDOW_PER_WORKER, AppliedWindow
from src.ps.shards.rounds import RoundCertificate
from src.ps.state.aggregation import Contribution, ModelState, RequestLog, SyncRound
from src.ps.state.served_model import ServedModel
from src.ps.state.slice_pipeline import SlicePipeline
from src.telemetry import tracing
from src.training.lr_schedule import is_constant, scheduled_learning_rate
from src.transport.errors import PushRefused

logger = logging.getLogger(__name__)


class Updates:
    """The sync barrier or async apply of one server (see the module docstring).

    Args:
        on_update: called after each update with ``(version, epochs it finished, samples applied before it)``.
        check_done: called when handing out work may have ended the run.
        certify: shard 0 of a sharded server: signs each sync version's certificate (``(version, pushes,
            rate)``; :func:`src.ps.shards.rounds.certify` with the run's key), kept in :attr:`certificate`.
    """

    def __init__(
        self,
        config: Config,
        *,
        work: WorkSource,
        members: Membership,
        model: ServedModel,
        requests: RequestLog,
        totals: RunTotals,
        control: ServerControl,
        log: MetricsLogger,
        on_update: Callable[[int, list[int], int], None],
        check_done: Callable[[], None],
        events_later: bool = False,
        certify: Callable[[int, list[tuple[int, int]], float], RoundCertificate] | None = None,
    ):
        self.config = config
        self._events_later = events_later  # push and update events: written once the reply is out (ServerCore)
        self.mode = config.system.aggregation_mode
        self.num_workers = config.system.num_workers
        self.work, self.members, self.requests = work, members, requests
        self.totals, self.control, self.log = totals, control, log
        self._on_update, self._check_done = on_update, check_done
        self.model = model
        self._round: SyncRound | None = None
        self._started = self.mode == "async"  # sync waits for every worker before its first round
        self._to_deliver: dict[int, list[Batch]] = {}  # work handed out, not yet in a reply
        self._ledger: list[torch.Tensor] | None = None  # system.gradient_ledger: sum of the applied gradients (float64)
        self._overriding_schedule: set[int] = set()  # workers warned that their own learning rates win
        self.pipeline: SlicePipeline | None = None  # system.pipelined_replies (set by the server core)
        self._pushed_samples: dict[int, int] = {}  # each worker's samples in its newest applied push (sync)
        self._certify = certify
        self.step_s = 0.0  # seconds of the sync rounds' optimizer steps (a shard's load in a sharded run's summary)
        self._round_certificate = b""
        self.window = AppliedWindow(WINDOW_PER_WORKER * self.num_workers)
        """Shard 0 of a sharded async server: the newest versions' certificates (:mod:`src.ps.shards.asynchronous`)."""

    @property
    def certificate(self) -> bytes:
        """Shard 0 of a sharded server (``certify``): the encoded certificate of the newest sync version
        (:mod:`src.ps.shards.rounds`), or async the window of the newest versions' (:mod:`src.ps.shards.asynchronous`);
        empty before the first."""
        if self.mode == "sync":
            return self._round_certificate
        self._certify_forgotten()
        return self.window.encoded

    def _certify_forgotten(self) -> None:
        """Async: the workers whose momentum was dropped since the last version go into the window, at this
        version, so a follower drops it at the same point as shard 0 (before its next pull's reply)."""
        if self.state is not None and self.state.forgotten:
            forgotten = [(worker, FORGET) for worker in self.state.forgotten]
            self.state.forgotten.clear()
            self.window.add(self._certify(self.state.version, forgotten, self.state.learning_rate, ()))

    @property
    def state(self) -> ModelState | None:
        """The served model's parameters and optimizer (``None`` until it is installed)."""
        return self.model.state

    # ------------------------------------------------------------------------- work and members

    def deliver(self, worker: int) -> tuple[list[Batch], bool] | None:
        """The work a sync round handed ``worker`` and no reply carried yet (``None``: none)."""
        if worker in self._to_deliver:
            return self._to_deliver.pop(worker), False
        return None

    def forget(self, worker: int) -> bool:
        """``worker`` left: its undelivered work and its place in the barrier go; whether it was in the round."""
        self._to_deliver.pop(worker, None)
        return self._round is not None and self._round.drop(worker)

    def maybe_start(self) -> None:
        """sync: the first round starts once every worker id has registered and every live one is ready."""
        ready = self.members.ready()
        if (
            not self._started
            and ready
            and len(self.members.current) == self.num_workers
            and ready == self.members.live()
            and not self.members.awaited()
        ):
            self._started = True
        if self._started and self.mode == "sync":
            self._open_round()

    def maybe_complete_round(self) -> None:
        """Apply the round if every expected worker is in; open the next one when none is open."""
        round_ = self._round
        if round_ is not None and round_.complete():
            contributions = round_.contributions()
            with tracing.span("average", pushes=len(contributions)):
                gradients, buffers = self.state.average(contributions)
            self._set_step_learning_rate(contributions)
            rate = self.state.learning_rate
            started = time.perf_counter()
            with tracing.span("optimizer_step"):
                self.state.step(gradients, buffers)
            self.step_s += time.perf_counter() - started
            self._round = None
            self._pushed_samples.update((c.worker, c.num_samples) for c in contributions)
            if self._certify is not None:  # shard 0 of a sharded server: the followers apply what this says
                pushes = [(c.worker, c.request_id) for c in contributions]
                self._round_certificate = self._certify(self.state.version, pushes, rate).encode()
            self._applied(contributions)
        if self._round is None or not self._round.expected:
            self._round = None
            self._open_round()

    def _open_round(self) -> None:
        """sync: hand every ready worker its next work for the current version."""
        if not self._started or self._round is not None or self.state is None:
            return
        handed = self.work.start_round(self.members.ready(), self.members.live())
        if handed:
            self._round = SyncRound(self.state.version, set(handed))
            if self.pipeline is not None:  # system.pipelined_replies: the round's workers and their samples
                self.pipeline.open_round(self.state.version, self._round_samples(handed))
            self._to_deliver.update(handed)
            self.totals.training_clock_starts()
        self._check_done()

    def _round_samples(self, handed: dict[int, list[Batch]]) -> dict[int, int]:
        """The samples each worker of a sync round will push, for the slice pipeline: those handed to it or, where
        the workers' own loops choose their batches (the library: nothing is handed), a guess, the samples of its
        newest applied push (none yet: 0, left out of the round). A wrong guess only voids the round's slices."""
        if self.work.owns_data:
            return {worker: self._pushed_samples.get(worker, 0) for worker in handed}
        return {worker: sum(len(b.indices) for b in batches) for worker, batches in handed.items()}

    # ------------------------------------------------------------------------- pushes

    def apply(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> pb.PushReply:
        """Add the decoded push to the barrier (sync) or apply it with its staleness weight (async): the verdict."""
        if request.HasField("learning_rate") and member.worker_id not in self._overriding_schedule:
            self._overriding_schedule.add(member.worker_id)
            self._warn_schedule_overridden(member, request)
        with tracing.span("apply", worker=member.worker_id, request_id=request.request_id):
            return (self._add_to_round if self.mode == "sync" else self._apply_now)(member, request, contribution)

    def _warn_schedule_overridden(self, member: Member, request: pb.PushRequest) -> None:
        """A worker's first push with its own learning rate, when the server has a schedule it will not apply."""
        schedule = self.config.training.lr_schedule
        if is_constant(schedule):
            return
        logger.warning(
            "worker %d sends the learning rate of its own scheduler with its pushes: the server "
            "applies it, not its training.lr_schedule (%s)",
            member.worker_id,
            schedule.kind,
        )
        self.log.event(
            "lr_schedule_overridden",
            worker=member.worker_id,
            learning_rate=request.learning_rate,
            schedule=schedule.kind,
        )

    def _add_to_round(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> pb.PushReply:
        round_ = self._round
        if not contribution.gradients:  # a skipped step (client-owned work): this version goes on without it
            if (
                round_ is None
                or request.base_version != round_.version
                or member.worker_id not in round_.expected
                or member.worker_id in round_.arrived
            ):
                raise PushRefused(
                    "FAILED_PRECONDITION",
                    f"skipped step of worker {member.worker_id} for version {request.base_version}, which is "
                    f"not its turn (barrier at version {round_.version if round_ else self.state.version})",
                )
            round_.drop(member.worker_id)  # it is in the next round again
            reply = self._skipped(member, request)
            self.maybe_complete_round()
            return reply
        if round_ is None or request.base_version != round_.version:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"sync push for version {request.base_version}, but the barrier is at "
                f"version {round_.version if round_ else self.state.version}",
            )
        try:
            round_.add(contribution)
        except ValueError as exc:
            raise PushRefused("FAILED_PRECONDITION", str(exc)) from None
        self.totals.staleness_histogram[0] += 1  # a sync push is always for the current version
        self._log_push(member, request, contribution, staleness=0, weight=1.0, accepted=True)
        self.maybe_complete_round()
        return pb.PushReply(accepted=True, staleness=0, weight=1.0)

    def _apply_now(self, member: Member, request: pb.PushRequest, contribution: Contribution) -> pb.PushReply:
        if not contribution.gradients:
            return self._skipped(member, request)
        if request.base_version > self.state.version:
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"base_version {request.base_version} is ahead of the server's version {self.state.version}",
            )
        staleness = self.state.version - request.base_version
        self.totals.staleness_histogram[staleness] += 1
        policy = self.control.staleness_policy
        weight, reason = policy.verdict(staleness)
        shards, rolled_back = {}, ()
        if request.commit:  # a sharded server: every shard's staleness judged here, each shard's verdict its own
            shards = {entry.shard: entry.staleness for entry in request.shard_staleness}
            verdicts = {0: (weight, reason), **{k: policy.verdict(tau) for k, tau in shards.items()}}
            refusals = [(k, why) for k, (shard_weight, why) in sorted(verdicts.items()) if shard_weight is None]
            if refusals and len(refusals) < len(verdicts):  # applied where accepted, rolled back on the others
                rolled_back = tuple(k for k, _ in refusals)
                reason = "; ".join(f"shard {k}: {why}" for k, why in refusals)
        accepted = weight is not None or bool(rolled_back)
        self._log_push(
            member,
            request,
            contribution,
            staleness=staleness,
            weight=weight if weight is not None else (0.0 if accepted else None),
            accepted=accepted,
            reason=reason,
            **({"shard_staleness": [staleness, *(shards[k] for k in sorted(shards))]} if shards else {}),
            **({"rolled_back": list(rolled_back)} if rolled_back else {}),
        )
        if not accepted:
            self.totals.counters["pushes_rejected"] += 1
            return pb.PushReply(
                accepted=False, staleness=staleness, weight=0.0, reason=f"rejected by the staleness policy: {reason}"
            )
        self._set_step_learning_rate([contribution])
        if self._certify is not None:
            self._certify_forgotten()
        if 0 in rolled_back:  # too stale on this shard: the version passes here, the shards that took it apply it
            self.state.pass_version()
        else:
            self.state.step(contribution.gradients, contribution.buffers, weight, worker=member.worker_id)
        if self._certify is not None:  # shard 0 of a sharded server: the followers apply what the window says
            pushes = [(member.worker_id, request.request_id)]
            self.window.add(self._certify(self.state.version, pushes, self.state.learning_rate, rolled_back))
        here = 0 in rolled_back
        if here:
            self.totals.counters[ROLLED_BACK_HERE] += 1  # the followers count theirs (ShardLoad.rolled_back)
        self._applied([contribution], **({"rolled_back": True} if here else {}))
        return pb.PushReply(
            accepted=True,
            staleness=staleness,
            weight=weight if weight is not None else 0.0,
            rolled_back=rolled_back,
            reason=f"rolled back by the staleness policy on {reason}" if rolled_back else "",
        )

    def _skipped(self, member: Member, request: pb.PushRequest) -> pb.PushReply:
        self.totals.counters["steps_skipped"] += 1
        self.log.event("push_skipped", **self._push_fields(member, request))
        return pb.PushReply(accepted=False, reason="skipped step (no gradient)", staleness=0, weight=0.0)

    def _log_push(
        self,
        member: Member,
        request: pb.PushRequest,
        contribution: Contribution,
        *,
        staleness: int,
        weight: float | None,
        accepted: bool,
        reason: str | None = None,
        **fields: object,
    ) -> None:
        """The push event: its Staleness, weight and verdict (with the policy's reason), batches and timings."""
        metrics = request.metrics
        event = self.log.event(
            "push",
            later=self._events_later,
            **self._push_fields(member, request),
            staleness=staleness,
            weight=weight,
            accepted=accepted,
            reason=reason,
            num_samples=request.num_samples,
            batch_ids=list(request.batch_ids),
            epoch=metrics.epoch,
            loss=metrics.loss,
            gradient_time_s=metrics.gradient_time_s,
            compression_time_s=metrics.compression_time_s,
            communication_time_s=metrics.communication_time_s,
            **fields,
        )
        # the controller's inputs (its decisions come at evaluations)
        self.control.observe_push(event, contribution.payload_bytes, self.state.dense_bytes)

    def _push_fields(self, member: Member, request: pb.PushRequest) -> dict[str, int]:
        """What every push event says first: whose push, which request, its base version and the server's."""
        return {
            "worker": member.worker_id,
            "incarnation": member.incarnation,
            "request_id": request.request_id,
            "base_version": request.base_version,
            "version": self.state.version,
        }

    # ------------------------------------------------------------------------- updates

    def _applied(self, contributions: list[Contribution], **fields: object) -> None:
        """The update just stepped holds everything its contributors held: bookkeeping, events (``fields`` added to
        the update's), then ``on_update``."""
        counters = self.totals.counters
        samples, epochs_done = [], []
        samples_before = counters["samples_applied"]
        for contribution in contributions:
            self.requests.mark(contribution.worker, contribution.request_id, applied=True)  # before a checkpoint
            if self.config.system.gradient_ledger:
                self._add_to_ledger(contribution.gradients)
            batches, finished_epochs = self.work.applied(contribution.worker)
            samples += [[b.epoch, list(b.indices)] for b in batches]
            epochs_done += finished_epochs
            counters["samples_applied"] += contribution.num_samples  # checked to equal its batches' samples
        counters["pushes_applied"] += len(contributions)
        self.log.event(
            "update",
            later=self._events_later,
            version=self.state.version,
            requests=[[c.worker, c.request_id] for c in contributions],
            samples=samples,
            num_samples=sum(c.num_samples for c in contributions),
            learning_rate=self.state.learning_rate,
            **fields,
        )
        if all(c.learning_rate is None for c in contributions):
            self.schedule_next_step()
        self._on_update(self.state.version, epochs_done, samples_before)

    def _set_step_learning_rate(self, contributions: list[Contribution]) -> None:
        """The rate of the update about to be applied: the one the pushes' own schedulers sent (their mean),
        else the schedule's (already set for this version)."""
        sent = [c.learning_rate for c in contributions if c.learning_rate is not None]
        if sent:
            self.state.set_learning_rate(sum(sent) / len(sent))
        else:
            self.schedule_next_step()

    def schedule_next_step(self) -> None:
        """``training.lr_schedule``'s rate for the step from the current version (the lookahead point uses it too)."""
        t = self.config.training
        self.state.set_learning_rate(scheduled_learning_rate(t.lr_schedule, t.learning_rate, self.state.version))

    def _add_to_ledger(self, gradients: list[torch.Tensor]) -> None:
        if self._ledger is None:
            self._ledger = [torch.zeros(g.shape, dtype=torch.float64) for g in gradients]
        for total, gradient in zip(self._ledger, gradients):
            total.add_(gradient.to(torch.float64))

    def save_ledger(self, path: Path) -> None:
        """``system.gradient_ledger``: the sum of the applied gradients, by parameter name (zeros: none applied)."""
        totals = self._ledger or [torch.zeros(p.shape, dtype=torch.float64) for p in self.state.params]
        torch.save({"applied": dict(zip(self.state.param_names, totals))}, path)
