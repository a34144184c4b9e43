"""How the parameter server's core says no beyond one call: the membership codes, and a run that failed.

A call the core refuses raises :class:`~src.transport.errors.Refused` (a push's contents:
:class:`~src.transport.errors.PushRefused`), which every transport maps to its own errors; a caller that is not a live
member is refused with :data:`MEMBERSHIP_CODES`' status, and a background checkpoint or evaluation that failed ends
the run with :class:`RunFailed`. A worker told that its incarnation is over, with no rejoin left, stops with
:class:`IncarnationRevoked`. None of this imports torch: a launcher names these errors without loading it.
"""

from __future__ import annotations

MEMBERSHIP_CODES = {"unknown": "NOT_FOUND", "revoked": "ABORTED", "finished": "FAILED_PRECONDITION"}
"""Status of a call whose caller is not a live member: register again / this incarnation is over / done."""


class RunFailed(RuntimeError):
    """A background checkpoint or evaluation failed: the run stops with this error."""


class IncarnationRevoked(RuntimeError):
    """The server declared this incarnation failed (silent too long, or replaced) and this process may not
    rejoin (no :class:`~src.ps.worker.membership.Rejoins` budget, or it is spent): this process must stop."""
