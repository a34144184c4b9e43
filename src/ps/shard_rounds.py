"""Sync versions across parameter-server shards: every shard applies version v from the same workers' pushes.

With the server split across shards (:mod:`src.ps.placement`), shard 0 keeps what one process must decide:
membership, the work plan and the sync barrier. The other shards (*followers*) apply what shard 0 decided,
on their own slices. The protocol, per sync version v:

1. A worker handed work for v sends its slices to every follower. A follower *holds* the contribution
   (decoded, not applied: :meth:`FollowerRounds.hold`) and acknowledges it.
2. Once every follower has acknowledged, the worker pushes its own slices to shard 0. Shard 0's barrier
   counts only such pushes, so every contribution it applies is held on every follower.
3. Shard 0 closes the barrier as today (a worker that failed is dropped with its contribution), applies its
   slices, and signs a :class:`RoundCertificate`: the version, the contributors (worker id and request id)
   and the learning rate of the step. Its reply to each worker carries the certificate.
4. The worker's next message to each follower carries the certificate (the first to arrive wins; the others
   are answered as already applied). The follower applies v from exactly the certified contributions, in
   worker-id order with shard 0's rate (:meth:`FollowerRounds.apply`): the same arithmetic on its slices as
   shard 0's on its own and as one unsharded server's on the whole model (the optimizers are elementwise,
   ``tests/test_shard_model.py``). What it held from a worker that is not certified is dropped: a worker that
   failed mid-push contributes on no shard for that version.

A follower never sees a push for v+1 before it can apply v: the worker gets v's certificate before it is
handed work for v+1, and carries it with that push. A follower that cannot apply a certificate (it lacks a
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

from src.common.sessions import signature
from src.ps.aggregation import Contribution, ModelState


class ShardBehind(RuntimeError):
    """A follower cannot apply a certified version: it lacks a certified contribution or an earlier version."""


class ForgedCertificate(ValueError):
    """A round certificate whose signature does not hold."""


@dataclass(frozen=True)
class RoundCertificate:
    """Shard 0's word on sync version ``version``: applied from ``contributors`` ((worker id, request id), by
    worker id) at ``learning_rate``; ``tag`` signs the rest."""

    version: int
    contributors: tuple[tuple[int, int], ...]
    learning_rate: float
    tag: bytes = b""

    def body(self) -> bytes:
        """The signed bytes: version, rate, then each contributor."""
        head = struct.pack(">Qd", self.version, self.learning_rate)
        return head + b"".join(struct.pack(">iQ", worker, request) for worker, request in self.contributors)


def certify(key: bytes, version: int, contributors: list[tuple[int, int]], learning_rate: float) -> RoundCertificate:
    """Shard 0's signed certificate of ``version`` (contributors sorted by worker id; at least one: a barrier that
    every worker left applies nothing, so it has no certificate)."""
    if not contributors:
        raise ValueError(f"version {version}: a certificate needs at least one contributor")
    unsigned = RoundCertificate(version, tuple(sorted(contributors)), float(learning_rate))
    return replace(unsigned, tag=_tag(key, unsigned))


def _tag(key: bytes, certificate: RoundCertificate) -> bytes:
    return signature(key, b"dts round v1", certificate.body())


class FollowerRounds:
    """A follower shard's side of the sync protocol (see the module docstring).

    Args:
        state: the follower's part of the model (its :class:`~src.ps.aggregation.ModelState`).
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
        request id), which changes nothing.

        Raises:
            ValueError: the push is for another version than the next (a stale push, or one a certificate
                should have preceded), or the worker already holds another push for it.
        """
        if version != self.next_version:
            raise ValueError(
                f"worker {contribution.worker}: a push for version {version}, but this shard's next version is "
                f"{self.next_version}"
            )
        held = self.held.get(contribution.worker)
        if held is not None:
            if held.request_id == contribution.request_id:
                return False
            raise ValueError(
                f"worker {contribution.worker}: push {contribution.request_id} for version {version}, but push "
                f"{held.request_id} is held for it"
            )
        self.held[contribution.worker] = contribution
        return True

    def apply(self, certificate: RoundCertificate) -> bool:
        """Apply the certified version; returns False when it is applied here already (nothing changes).

        Raises:
            ForgedCertificate: the signature does not hold.
            ShardBehind: the version is not the next one, or a certified contribution is not held.
        """
        if not hmac.compare_digest(certificate.tag, _tag(self._key, certificate)):
            raise ForgedCertificate(f"the certificate of version {certificate.version} is not shard 0's")
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
