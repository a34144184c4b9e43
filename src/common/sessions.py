"""Sessions that any parameter-server shard can check on its own: signed by the run's secret, not looked up.

A worker's session (issued at registration, carried by every later call) is a random secret that the issuing
server looks up in its membership. With the server split across shards, every shard must refuse a forged or
stale session, and none should ask shard 0 (which registers workers) on each call. So a signed session holds
what a shard needs to judge it: the incarnation it was issued to, a random nonce, and a tag,
HMAC-SHA256(key, worker id, incarnation, nonce) cut to 16 bytes; the key is derived from a secret every shard of
the run is given (:func:`session_key`). Forging one needs the key; a tag is checked in constant time.

Pure: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Callable

_HEADER = struct.Struct(">Q8s")  # incarnation, nonce
TAG_BYTES = 16
SESSION_BYTES = _HEADER.size + TAG_BYTES
"""A signed session's length: incarnation (8), nonce (8), tag (16)."""


def session_key(secret: bytes) -> bytes:
    """The signing key of a run's sessions, derived from the secret its shards share (the auth token, or one
    the launcher makes): a key for this use only, so a tag never reveals anything about the token."""
    if not secret:
        raise ValueError("the sessions' secret is empty: the shards of a run need a shared secret")
    return hmac.new(secret, b"dts worker sessions v1", hashlib.sha256).digest()


def signature(key: bytes, purpose: bytes, body: bytes) -> bytes:
    """The run's 16-byte tag of ``body`` for ``purpose`` (HMAC-SHA256 under ``key``, cut): what a session and a
    shard's round certificate (:mod:`src.ps.shards.rounds`) carry; the purpose keeps one's tag from passing as
    the other's. Compare tags with :func:`hmac.compare_digest`."""
    return hmac.new(key, purpose + body, hashlib.sha256).digest()[:TAG_BYTES]


class ForgedSession(ValueError):
    """A session that no holder of the key issued (or not to this worker id)."""


class SessionSigner:
    """Issue and open signed sessions with ``key`` (:func:`session_key`); ``nonce``: random bytes (injectable)."""

    def __init__(self, key: bytes, *, nonce: Callable[[int], bytes] = secrets.token_bytes):
        self._key = key
        self._nonce = nonce

    def issue(self, worker_id: int, incarnation: int) -> bytes:
        """A new session of ``worker_id``'s incarnation ``incarnation``."""
        header = _HEADER.pack(incarnation, self._nonce(8))
        return header + self._tag(worker_id, header)

    def open(self, worker_id: int, session: bytes) -> int:
        """The incarnation ``session`` was issued to, for ``worker_id``; raises :class:`ForgedSession` otherwise."""
        if len(session) != SESSION_BYTES:
            raise ForgedSession(f"worker {worker_id}: a session is {SESSION_BYTES} bytes, got {len(session)}")
        header, tag = session[: _HEADER.size], session[_HEADER.size :]
        if not hmac.compare_digest(tag, self._tag(worker_id, header)):
            raise ForgedSession(f"worker {worker_id}: the session's signature does not hold")
        return _HEADER.unpack(header)[0]

    def _tag(self, worker_id: int, header: bytes) -> bytes:
        return signature(self._key, b"dts session v1", struct.pack(">i", worker_id) + header)
