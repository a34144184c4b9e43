"""De-dup of pushes: a push is admitted once per request id, and a retry is answered, never applied twice.

Each push carries a request id unique per push. The first copy is admitted (after checking that it
covers the work its worker holds) and stays in progress until its reply is made or it is abandoned;
a retry of a handled push gets the reply again (its bytes as kept, or its verdict with the
parameters as they are now), a copy of an older push is refused. Outcomes live in the
:class:`~src.ps.state.aggregation.RequestLog`, which checkpoints keep. Everything here runs with the core's lock held.
"""

from __future__ import annotations

from src import parameter_server_pb2 as pb
from src.coordinator import Batch, Member
from src.metrics import MetricsLogger
from src.ps.server.control import ServerControl
from src.ps.server.totals import RunTotals
from src.ps.server.work_source import WorkRefused, WorkSource
from src.ps.state.aggregation import RequestLog
from src.ps.state.replies import StoredReply
from src.ps.state.served_model import ServedModel
from src.telemetry import tracing
from src.transport.errors import PushRefused
from src.transport.wire import Pieces


class Pushes:
    """Admits pushes, makes and remembers their replies (see the module docstring)."""

    def __init__(
        self,
        *,
        model: ServedModel,
        requests: RequestLog,
        work: WorkSource,
        control: ServerControl,
        totals: RunTotals,
        log: MetricsLogger,
    ):
        self.model, self.requests, self.work = model, requests, work
        self.control, self.totals, self.log = control, totals, log

    def admit(self, member: Member, request: pb.PushRequest) -> Member | bytes | Pieces | object:
        """``member`` (the push is now in progress), or the reply of a retried push, or ``RequestLog.IN_PROGRESS``."""
        worker_id, request_id = member.worker_id, request.request_id
        if request_id == 0:
            raise PushRefused("INVALID_ARGUMENT", "push: request_id must be non-zero (unique per push)")
        remembered = self.requests.lookup(worker_id, request_id)
        if remembered is RequestLog.SUPERSEDED:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"push {request_id} of worker {worker_id} was handled already "
                f"and is not its newest push (request ids are unique per push)",
            )
        replies, control = self.model.replies, self.control.control
        if isinstance(remembered, StoredReply):  # a retry of a handled push, replies as views
            return replies.stored(worker_id, remembered, control)
        if isinstance(remembered, pb.PushReply):  # a retry of a handled push, dense replies: the verdict again,
            return replies.rebuilt(worker_id, remembered, control)  # with the parameters as they are now
        if remembered is not None:
            return remembered  # IN_PROGRESS, or a retry of a handled push: answer again, apply nothing
        try:
            self.work.check_covers(worker_id, request)
        except WorkRefused as exc:
            raise PushRefused(exc.code, exc.message) from None
        self.requests.begin(worker_id, request_id)
        return member

    def reply(
        self,
        member: Member,
        request_id: int,
        verdict: pb.PushReply,
        work: tuple[list[Batch] | None, bool],
        *,
        parameters: bool = True,
        omit: list[int] = (),
    ) -> bytes | Pieces:
        """The serialized Push reply (verdict, parameters, ``work``), remembered for retries of ``request_id``;
        ``parameters=False``: without them (a sharded server's commit reply: the worker pulls every shard's), kept
        as it is. ``omit``: parameters the reply leaves empty, listed in ``provisional`` (the worker holds them:
        :mod:`src.ps.state.slice_pipeline`); a retry's reply carries them all (its connection was sent none)."""
        verdict.work.CopyFrom(self.work.message(*work))
        verdict.version = self.model.state.version
        verdict.control.CopyFrom(self.control.control)
        with tracing.span("reply", worker=member.worker_id):
            if parameters and omit:
                stored = pb.PushReply()
                stored.CopyFrom(verdict)  # a retry is rebuilt whole from the verdict
                verdict.provisional.extend(omit)
                reply = self.model.replies.serialize(verdict, member.worker_id, omit=omit)
            elif parameters:
                reply = self.model.replies.serialize(verdict, member.worker_id)
                stored = self.model.replies.kept_for_retry(reply, verdict)
            else:
                reply = stored = verdict.SerializeToString()
        self.requests.finish(member.worker_id, request_id, stored, applied=verdict.accepted)
        return reply

    def abandon(self, worker_id: int, request_id: int) -> None:
        """A push ended without a reply (refused, or its caller gone): a retry is handled afresh."""
        if self.requests.lookup(worker_id, request_id) is RequestLog.IN_PROGRESS:
            self.requests.abandon(worker_id, request_id)

    def refused(self, worker_id: int | None, request_id: int, refused: PushRefused) -> None:
        """Count and log a refused push (the driver then refuses the call)."""
        self.totals.counters["pushes_refused"] += 1
        self.log.event(
            "push_refused", worker=worker_id, request_id=request_id, code=refused.code, reason=refused.message
        )
