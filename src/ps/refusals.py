"""How the parameter server's core says no: the refusals each transport maps to its own errors.

Raised by the core (:mod:`src.ps.core`) and its collaborators (the push decoder, the update rules); kept
apart so that those modules and the drivers import them without importing the core.
"""

from __future__ import annotations

MEMBERSHIP_CODES = {"unknown": "NOT_FOUND", "revoked": "ABORTED", "finished": "FAILED_PRECONDITION"}
"""Status of a call whose caller is not a live member: register again / this incarnation is over / done."""


class Refused(Exception):
    """A call the server refuses: ``code`` names the status (gRPC's names), ``message`` says what was wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class PushRefused(Refused):
    """A push refused for what it holds (malformed, not the caller's work, wrong version): counted and logged
    as ``push_refused`` (:meth:`ServerCore.refused <src.ps.core.ServerCore.refused>`); a call refused for who
    makes it is a plain :class:`Refused`."""


class RunFailed(RuntimeError):
    """A background checkpoint or evaluation failed: the run stops with this error."""
