"""How a call of the parameter server's protocol fails, on either side, whatever carries it.

A server's core refuses a call with :class:`Refused` (a push for what it holds: :class:`PushRefused`); every server
transport maps it to its own error, and every client raises :class:`CallError` for it.

Both clients (gRPC, :mod:`src.transport.grpc`; binary frames on TCP, :mod:`src.transport.tcp`) raise it, and the
worker's step machine (:mod:`src.ps.worker.machine`) reads it, as the virtual clock's calls make it: a ``code``, one of
gRPC's status names as strings (``"UNAVAILABLE"``, ``"NOT_FOUND"``, ``"ABORTED"``, ...; the server core names its
refusals with them, :mod:`src.ps.state.refusals`), and a ``message`` that says what was wrong. So nothing on the
worker's side, and nothing on the TCP transport's, depends on gRPC.
"""

from __future__ import annotations

STATUS_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
"""The status codes by number (gRPC's numbering, which a TCP error frame carries): ``STATUS_NAMES[14]`` is
``"UNAVAILABLE"``."""
RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
"""Codes of a call worth sending again as it was: it may not have reached the server (a push keeps its request id,
which the server applies at most once)."""


class CallError(Exception):
    """A call that failed: the server refused it (``code`` the status it named), or the connection failed
    (``UNAVAILABLE``; a passed deadline ``DEADLINE_EXCEEDED``).

    Args:
        code: the status's name (gRPC's: ``"UNAVAILABLE"``, ``"INVALID_ARGUMENT"``, ...).
        message: what was wrong, in one line.
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        """Whether sending the same request again may succeed (:data:`RETRYABLE`)."""
        return self.code in RETRYABLE


class Refused(Exception):
    """A call the server refuses: ``code`` names the status (gRPC's names), ``message`` says what was wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class PushRefused(Refused):
    """A push refused for what it holds (malformed, not the caller's work, wrong version): counted and logged
    as ``push_refused`` (:meth:`ServerCore.refused <src.ps.server.core.ServerCore.refused>`); a call refused for who
    makes it is a plain :class:`Refused`."""


__all__ = ["RETRYABLE", "STATUS_NAMES", "CallError", "PushRefused", "Refused"]
