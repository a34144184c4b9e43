"""Sync versions across parameter-server shards: every shard applies version v from the same workers' pushes.

With the server split across shards (:mod:`src.ps.shards.placement`), shard 0 keeps what one process must decide:
membership, the work plan and the sync barrier. The other shards (*followers*) apply what shard 0 decided,
on their own slices. The protocol, per sync version v (the worker's messages to different shards go out at once,
so each shard's link carries only its share of the bytes):

1. **Hold.** A worker handed work for v sends its slices to every shard (``PushRequest.hold``). Each shard
   *holds* the contribution (decoded, not applied: :meth:`FollowerRounds.hold` on a follower, a held push on
   shard 0) and acknowledges it.
2. **Commit.** Once every shard has acknowledged, the worker commits the push to shard 0
   (``PushRequest.commit``, no tensors). Shard 0's barrier counts only committed pushes, so every contribution
   it applies is held on every follower.
3. **Certificate.** Shard 0 closes the barrier as today (a worker that failed is dropped with its
   contribution), applies its slices, and signs a :class:`RoundCertificate`: the version, the contributors
   (worker id and request id) and the learning rate of the step. Its commit reply carries the verdict, the next
   work and the certificate (``PushReply.certificate``), and no parameters.
4. **Pull.** The worker pulls every shard's slices at once (``PullRequest.parameters_only``); a pull from a
   follower carries the certificate. The follower applies v from exactly the certified contributions (the first
   pull to arrive applies it; the others find it applied), in worker-id order with shard 0's rate
   (:meth:`FollowerRounds.apply`): the same arithmetic on its slices as shard 0's on its own and as one
   unsharded server's on the whole model (the optimizers are elementwise, ``tests/test_shard_model.py``). What it
   held from a worker that is not certified is dropped: a worker that failed mid-push contributes on no shard
   for that version.

A follower never holds a push for v+1 before it can apply v: a worker computes v+1's gradient on the parameters
its certificate-carrying pull of v returned. A follower that cannot apply a certificate (it lacks a
certified contribution, or is more than one version behind: it restarted from an older checkpoint) raises
:class:`ShardBehind`; redoing those versions is the shard recovery's job.

The certificate is signed with the run's session key (:func:`src.common.sessions.session_key`): a follower
trusts shard 0's decision without asking it, and no worker can forge one.

Pure: no I/O; the follower's server core calls it with its lock held.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass, replace

from src.common.sessions import TAG_BYTES, signature
from src.ps.state.aggregation import Contribution, ModelState

_HEAD = struct.Struct(">Qd")  # version, learning rate
_COUNT = struct.Struct(">H")  # async: how many shards rolled the version's push back
_SHARD = struct.Struct(">H")  # async: a shard that rolled it back
_CONTRIBUTOR = struct.Struct(">iQ")  # worker id, request id


class ShardBehind(RuntimeError):
    """A follower cannot apply a certified version: it lacks a certified contribution or an earlier version."""


class ForgedCertificate(ValueError):
    """A round certificate whose signature does not hold."""


@dataclass(frozen=True)
class RoundCertificate:
    """Shard 0's word on sync version ``version``: applied from ``contributors`` ((worker id, request id), by
    worker id) at ``learning_rate``; ``tag`` signs the rest. ``rolled_back``: an async version's (``None`` for a sync
    one's): the shards whose staleness was over the bound, where the version passes without changing anything
    (:mod:`src.ps.shards.asynchronous`)."""

    version: int
    contributors: tuple[tuple[int, int], ...]
    learning_rate: float
    tag: bytes = b""
    rolled_back: tuple[int, ...] | None = None

    def body(self) -> bytes:
        """The signed bytes: version, rate, (async) the shards that rolled it back, then each contributor."""
        head = _HEAD.pack(self.version, self.learning_rate)
        if self.rolled_back is not None:
            head += _COUNT.pack(len(self.rolled_back)) + b"".join(_SHARD.pack(shard) for shard in self.rolled_back)
        return head + b"".join(_CONTRIBUTOR.pack(worker, request) for worker, request in self.contributors)

    def rolls_back(self, shard: int) -> bool:
        """Whether ``shard`` rolled this version's (async) push back."""
        return self.rolled_back is not None and shard in self.rolled_back

    def encode(self) -> bytes:
        """The certificate on the wire (``PushReply.certificate``, ``PullRequest.certificate``): body, then tag."""
        return self.body() + self.tag

    @classmethod
    def decode(cls, data: bytes, *, asynchronous: bool = False) -> RoundCertificate:
        """The certificate in ``data`` (:meth:`encode`'s bytes, of an ``asynchronous`` version's or a sync one's; the
        tag is checked where it is applied).

        Raises:
            ForgedCertificate: ``data`` is not a certificate's length.
        """
        start, shards = _HEAD.size, None
        if asynchronous:
            if len(data) < start + _COUNT.size:
                raise ForgedCertificate(f"a round certificate of {len(data)} bytes is malformed")
            (rolled,) = _COUNT.unpack_from(data, start)
            start += _COUNT.size
            if len(data) < start + rolled * _SHARD.size:
                raise ForgedCertificate(f"a round certificate of {len(data)} bytes is malformed")
            shards = tuple(_SHARD.unpack_from(data, start + i * _SHARD.size)[0] for i in range(rolled))
            start += rolled * _SHARD.size
        count, rest = divmod(len(data) - start - TAG_BYTES, _CONTRIBUTOR.size)
        if count < 1 or rest:
            raise ForgedCertificate(f"a round certificate of {len(data)} bytes is malformed")
        version, learning_rate = _HEAD.unpack_from(data)
        contributors = tuple(_CONTRIBUTOR.unpack_from(data, start + i * _CONTRIBUTOR.size) for i in range(count))
        return cls(version, contributors, learning_rate, bytes(data[len(data) - TAG_BYTES :]), shards)


def certify(
    key: bytes,
    version: int,
    contributors: list[tuple[int, int]],
    learning_rate: float,
    rolled_back: tuple[int, ...] | None = None,
) -> RoundCertificate:
    """Shard 0's signed certificate of ``version`` (contributors sorted by worker id; at least one: a barrier that
    every worker left applies nothing, so it has no certificate); ``rolled_back``: an async version's, the shards
    where its push is not applied (``None``: a sync version's)."""
    if not contributors:
        raise ValueError(f"version {version}: a certificate needs at least one contributor")
    shards = None if rolled_back is None else tuple(rolled_back)
    unsigned = RoundCertificate(version, tuple(sorted(contributors)), float(learning_rate), b"", shards)
    return replace(unsigned, tag=_tag(key, unsigned))


def _tag(key: bytes, certificate: RoundCertificate) -> bytes:
    return signature(key, b"dts round v1", certificate.body())


def check_signature(key: bytes, certificate: RoundCertificate) -> None:
    """Raise :class:`ForgedCertificate` unless shard 0 signed ``certificate`` with the run's ``key``."""
    if not hmac.compare_digest(certificate.tag, _tag(key, certificate)):
        raise ForgedCertificate(f"the certificate of version {certificate.version} is not shard 0's")


class FollowerRounds:
    """A follower shard's side of the sync protocol (see the module docstring).

    Args:
        state: the follower's part of the model (its :class:`~src.ps.state.aggregation.ModelState`).
        key: the run's session key (the certificates' signing key).
    """

    def __init__(self, state: ModelState, key: bytes):
        self.state = state
        self._key = key
        self.held: dict[int, Contribution] = {}
        """The contributions held for the next version (``state.version + 1``), by worker id."""

    @property
    def next_version(self) -> int:
        return self.state.version + 1

    def hold(self, version: int, contribution: Contribution) -> bool:
        """Hold a worker's slices for ``version``; returns False for a retry of the push already held (same
        request id), which changes nothing. Another push of the same worker replaces the one held (the worker
        registered again and redid its work: only the certificate says which push counts).

        Raises:
            ValueError: the push is for another version than the next (a stale push, or one a certificate
                should have preceded).
        """
        if version != self.next_version:
            raise ValueError(
                f"worker {contribution.worker}: a push for version {version}, but this shard's next version is "
                f"{self.next_version}"
            )
        held = self.held.get(contribution.worker)
        if held is not None and held.request_id == contribution.request_id:
            return False
        self.held[contribution.worker] = contribution
        return True

    def apply(self, certificate: RoundCertificate) -> bool:
        """Apply the certified version; returns False when it is applied here already (nothing changes).

        Raises:
            ForgedCertificate: the signature does not hold.
            ShardBehind: the version is not the next one, or a certified contribution is not held.
        """
        check_signature(self._key, certificate)
        if certificate.version <= self.state.version:
            return False
        if certificate.version != self.next_version:
            raise ShardBehind(
                f"certificate of version {certificate.version}, but this shard holds version {self.state.version}"
            )
        missing = [
            (worker, request)
            for worker, request in certificate.contributors
            if worker not in self.held or self.held[worker].request_id != request
        ]
        if missing:
            raise ShardBehind(
                f"version {certificate.version}: the certified pushes (worker, request) {missing} are not held here"
            )
        contributions = [self.held[worker] for worker, _ in certificate.contributors]
        self.state.set_learning_rate(certificate.learning_rate)
        self.state.step(*self.state.average(contributions))
        self.held.clear()  # what an uncertified worker sent is voided with the version
        return True
