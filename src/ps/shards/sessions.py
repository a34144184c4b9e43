"""What a parameter-server shard other than shard 0 knows of the workers: the sessions they present, checked alone.

Shard 0 registers workers (:class:`~src.coordinator.Membership`, with signed sessions:
:class:`~src.common.sessions.SessionSigner`); the other shards never see a registration. They check each call's
session by its signature, with no round trip to shard 0, and keep the newest incarnation they have seen of each
worker id: a session of an older incarnation is stale (its worker registered again) and refused, as is one of an
incarnation shard 0 said has failed (:meth:`ShardSessions.revoke`). The refusals are the membership's own
(:class:`~src.coordinator.MembershipError`): ``unknown`` for a forged session (the worker registers again with
shard 0), ``revoked`` for a stale or failed one.

Pure: no I/O; the shard's server core calls it with its lock held.
"""

from __future__ import annotations

from src.common.sessions import ForgedSession, SessionSigner
from src.coordinator import MembershipError


class ShardSessions:
    """The sessions a shard has accepted (see the module docstring).

    Args:
        signer: the run's signer (the same key as shard 0's).
        num_workers: worker ids are ``0 .. num_workers-1``.
    """

    def __init__(self, signer: SessionSigner, num_workers: int):
        self.signer = signer
        self.num_workers = num_workers
        self.newest: dict[int, int] = {}
        """The newest incarnation seen of each worker id."""
        self.revoked: set[tuple[int, int]] = set()

    def check(self, worker_id: int, session: bytes) -> int:
        """The incarnation making a call with ``session``; raises :class:`MembershipError` if it may not."""
        if not 0 <= worker_id < self.num_workers:
            raise MembershipError("unknown", f"worker_id {worker_id} is out of range 0..{self.num_workers - 1}")
        try:
            incarnation = self.signer.open(worker_id, session)
        except ForgedSession as forged:
            raise MembershipError("unknown", f"{forged} (register again)") from None
        newest = self.newest.get(worker_id, 0)
        if incarnation < newest:
            raise MembershipError(
                "revoked", f"worker {worker_id} incarnation {incarnation} is stale (incarnation {newest} is current)"
            )
        if (worker_id, incarnation) in self.revoked:
            raise MembershipError("revoked", f"worker {worker_id} incarnation {incarnation} was failed by shard 0")
        self.newest[worker_id] = incarnation
        return incarnation

    def revoke(self, worker_id: int, incarnation: int) -> None:
        """Shard 0 failed (or replaced) ``worker_id``'s incarnation ``incarnation``: its calls are refused here too."""
        self.revoked.add((worker_id, incarnation))
        self.newest[worker_id] = max(self.newest.get(worker_id, 0), incarnation)
