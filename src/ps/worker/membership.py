"""One worker process's place in a parameter-server run: its id, incarnation and session, and what a failed call means.

A worker registers (:meth:`Membership.register`: a new incarnation with its own session secret, which every later
call carries, so a late call from a failed incarnation is refused). A call that fails means one of three things
(:func:`failed_call`):

* **lost**: the server lost this session (it restarted, or a shard is starting again): register again; the
  registration says whether the push in flight was applied (the server knows its request ids);
* **revoked**: the server declared this incarnation failed while the process lived (a partition, a long pause, a hang
  that ended: it was silent longer than ``system.heartbeat_timeout``): register again as a new incarnation, at most
  ``system.max_rejoins`` times (:class:`Rejoins`), then stop with :class:`IncarnationRevoked`;
* neither: the call's own error, raised.

Pure: registration is an exchange (:mod:`src.ps.worker.calls`) that a driver carries.
"""

from __future__ import annotations

import logging
from typing import Literal, Sequence

from src import parameter_server_pb2 as pb
from src.ps.state.refusals import IncarnationRevoked
from src.ps.worker.calls import REGISTER, Call, Exchange
from src.transport.errors import CallError

logger = logging.getLogger(__name__)

LOST_SESSION_CODES = frozenset({"NOT_FOUND", "UNAVAILABLE"})
"""Codes of a call the server could not place: it restarted (or is restarting): register again."""
REVOKED_CODE = "ABORTED"
"""Code of a call from an incarnation the server declared failed or replaced."""

Failure = Literal["lost", "revoked"]
"""What a failed call means for the worker (see :func:`failed_call`)."""


class Rejoins:
    """A worker process's budget of rejoins after its incarnation was revoked (``system.max_rejoins``).

    A process the server declared failed while it was alive is otherwise healthy: it registers again as a new
    incarnation and goes on. The budget keeps a process that keeps being declared failed (a flapping link) from
    rejoining forever.
    """

    def __init__(self, worker_id: int | None, max_rejoins: int):
        self.worker_id = worker_id
        self.max_rejoins = max_rejoins
        self.used = 0

    def spend(self, reason: str) -> None:
        """One rejoin after the revocation ``reason`` (the server's message, which names the worker).

        Raises:
            IncarnationRevoked: the budget is spent (the message says so, and why the incarnation ended).
        """
        if self.used >= self.max_rejoins:
            spent = (
                f"rejoined {self.used} time{'s' if self.used != 1 else ''} already"
                if self.max_rejoins
                else "rejoining is off"
            )
            raise IncarnationRevoked(f"{reason}; {spent} (system.max_rejoins={self.max_rejoins}): this process stops")
        self.used += 1
        logger.warning("%s; rejoining as a new incarnation (rejoin %d/%d)", reason, self.used, self.max_rejoins)


def failed_call(code: str, message: str, worker_id: int | None, rejoins: Rejoins | None) -> Failure | None:
    """What a call that failed with ``code`` means for a worker: ``"lost"``, ``"revoked"`` (one rejoin spent) or
    ``None`` (neither: the caller raises the call's error).

    Raises:
        IncarnationRevoked: revoked, and no rejoin is left (or ``rejoins`` is ``None``).
    """
    if code == REVOKED_CODE:
        if rejoins is None:
            raise IncarnationRevoked(f"worker {worker_id}: {message}")
        rejoins.spend(message)
        return "revoked"
    if code in LOST_SESSION_CODES:
        return "lost"
    return None


class Membership:
    """A worker process's membership: who it is to the server now (see the module docstring).

    Args:
        worker_id: ``0..num_workers-1``; ``None``: the server picks the lowest free id at the first registration.
        rejoins: the budget of rejoins after a revocation (``None``: none; set it once the run's is known).
    """

    def __init__(self, worker_id: int | None, rejoins: Rejoins | None = None):
        self.worker_id = worker_id
        self.rejoins = rejoins
        self.caller = pb.Caller(worker_id=worker_id or 0)
        self.incarnation = 0
        self.registration: pb.RegisterReply | None = None
        self.last_failure: Failure | None = None
        """What the latest registration after the first followed."""

    def register(self, last_request_id: int = 0, carried_batch_ids: Sequence[int] = ()) -> Exchange[pb.RegisterReply]:
        """Register (again): ``last_request_id`` the push whose reply was lost (its reply says whether it was
        applied), ``carried_batch_ids`` the batches this process still carries. Returns the registration.

        Raises:
            CallError: the server refused (a wrong token, no free id) or was not there in time.
        """
        request = pb.RegisterRequest(
            worker_id=self.worker_id or 0,
            last_request_id=last_request_id,
            carried_batch_ids=list(carried_batch_ids),
            any_worker_id=self.registration is None and self.worker_id is None,
        )
        [reply] = yield [Call(0, REGISTER, request)]
        if isinstance(reply, CallError):
            raise reply
        self.registration = reply
        self.worker_id = reply.worker_id
        self.incarnation = reply.incarnation
        self.caller = pb.Caller(worker_id=reply.worker_id, session=reply.session)
        return reply

    def failure(self, error: CallError) -> Failure:
        """What ``error`` means (:func:`failed_call`); the failure is this process's last (:attr:`last_failure`).

        Raises:
            IncarnationRevoked: the server declared this incarnation failed, and it may not rejoin.
            CallError: ``error`` itself, for any other failure.
        """
        failure = failed_call(error.code, error.message, self.worker_id, self.rejoins)
        if failure is None:
            raise error
        self.last_failure = failure
        return failure


__all__ = ["Failure", "IncarnationRevoked", "Membership", "Rejoins", "failed_call"]
