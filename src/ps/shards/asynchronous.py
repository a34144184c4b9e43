"""Async pushes across parameter-server shards: each shard judges a push's staleness against its own version, a
push is applied on every shard whose staleness is within the bound and rolled back on the others (ps-lite's per-key
apply), and every version passes on every shard in the same order.

A worker's async step over ``S`` shards takes the sync protocol's three calls (:mod:`src.ps.shards.rounds`), each
to every shard at once:

1. **Hold.** The worker sends each shard its slices with ``base_version`` = that shard's version it last pulled.
   Each follower counts the push's staleness on arrival (its version minus that base), holds it with the weight
   the staleness policy gives that staleness (:meth:`FollowerAsync.hold`) and says the staleness
   (``PushReply.staleness``). Shard 0 holds its slices.
2. **Commit.** The worker commits to shard 0 with every follower's staleness (``PushRequest.shard_staleness``).
   Shard 0 judges every shard's staleness, its own too, with the run's staleness policy as it stands (the
   adaptive controller may have moved its bound).
   * **Every shard accepts:** shard 0 applies its slices with its weight, and the new version's certificate (one
     push, its rate) joins a window of the newest :data:`WINDOW_PER_WORKER` x workers certificates
     (:class:`AppliedWindow`).
   * **Some shards reject, some accept:** the push is applied, and the shards that rejected it *roll it back*.
     The certificate names them (``RoundCertificate.rolled_back``), and there the version passes without changing
     anything (:meth:`~src.ps.state.aggregation.ModelState.pass_version`); the reply names them too
     (``PushReply.rolled_back``), and the worker rolls back only those shards' residuals
     (:func:`src.ps.worker.machine.StepMachine.settle`): their compensated gradient goes back into the error feedback,
     so it travels with the worker's next push to those shards (the spec's Residual Rollback, per slice). The push's
     batches are done, as with any applied push.
   * **Every shard rejects:** no shard applies it: the worker rolls its whole push back into its error feedback
     and the push's batches stay with it, as an unsharded server's rejection does.

   Its reply carries the window (:func:`encode_chain`).
3. **Pull.** The worker pulls every shard, each follower's pull carrying the window. A follower applies the
   certified pushes it has not applied, in shard 0's order, each with the weight it judged, or passes the version
   where the certificate says it rolled the push back (:meth:`FollowerAsync.apply`). Every reply's window reaches
   every follower with the pulls of the worker that got it, so a follower is never more than a few versions
   behind shard 0, and a push whose worker died after its commit reaches the followers with the next worker's
   pulls.

With the lookahead correction (``system.async_correction``), shard 0 drops a worker's momentum when the worker
leaves (it failed, or finished): a certificate at the current version naming the workers with request id
:data:`FORGET` (0) joins the window then, and shard 0's Pull replies carry the window too, so a follower drops it
at the same point, before it answers the pull of the worker that registers again.

Why a rolled-back slice keeps the invariant of every unsharded run, every sample index of every epoch in exactly
one applied update, on every shard, with one work plan: the push is in the version on every shard (the events list
it on each), and what a shard rolled back is its slices' share of the gradient, which the worker's error feedback
holds and sends with its next push there, as it holds what top-k leaves out of a push. A worker that dies loses its
residuals, rolled-back ones included, as it loses what compression kept back. Only a push no shard accepts is
rejected as a whole: its batches are then carried, since no update holds them.

Why the same order everywhere: version ``v`` of every shard is then made of the same pushes (what
:func:`src.coordinator.check_shards` audits, as for sync), so the shards of an async run checkpoint at the same
versions and go back together to one when a shard dies (:mod:`src.ps.shards.recovery`).

A follower's version may lag shard 0's (until the next pull brings the window), so a follower judges a push
against fewer versions than shard 0 would: its staleness is its own, as each of ps-lite's servers counts its own.

Pure: no I/O; the follower's server core calls it with its lock held.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Callable

from src.ps.shards.rounds import ForgedCertificate, RoundCertificate, ShardBehind, check_signature
from src.ps.state.aggregation import Contribution, ModelState
from src.ps.state.staleness import StalenessPolicy

WINDOW_PER_WORKER = 4
"""The window holds the newest ``WINDOW_PER_WORKER * num_workers`` certificates: each worker pulls every follower
after each of its pushes, so a follower is at most about one version per worker behind shard 0."""

UNBOUNDED = 1 << 62
"""A staleness bound no push reaches."""

HELD_PER_WORKER = 4
"""A follower keeps a worker's newest few held pushes (one is in flight; the others were rejected or lost)."""

_LENGTH = struct.Struct(">H")
FORGET = 0
"""The request id in a certificate that names workers whose momentum is dropped at its version (request ids of pushes
are never 0)."""

ROLLED_BACK_HERE = "rolled_back_on_shard_0"
"""Shard 0's counter of the async pushes it rolled back on its own slices (a sharded run's per-shard load)."""


def encode_chain(certificates: list[RoundCertificate]) -> bytes:
    """Certificates on the wire, oldest first (``PushReply.certificate``, ``PullRequest.certificate``)."""
    parts = []
    for certificate in certificates:
        data = certificate.encode()
        parts.append(_LENGTH.pack(len(data)) + data)
    return b"".join(parts)


def decode_chain(data: bytes) -> list[RoundCertificate]:
    """The certificates in ``data`` (:func:`encode_chain`'s bytes).

    Raises:
        ForgedCertificate: ``data`` is not a chain of certificates.
    """
    certificates, offset = [], 0
    while offset < len(data):
        if offset + _LENGTH.size > len(data):
            raise ForgedCertificate(f"a certificate chain of {len(data)} bytes is malformed")
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if offset + length > len(data):
            raise ForgedCertificate(f"a certificate chain of {len(data)} bytes is malformed")
        certificates.append(RoundCertificate.decode(data[offset : offset + length], asynchronous=True))
        offset += length
    return certificates


class AppliedWindow:
    """Shard 0's newest async certificates (see the module docstring); ``length``: how many it keeps."""

    def __init__(self, length: int):
        self.length = length
        self._certificates: list[RoundCertificate] = []
        self._encoded = b""

    def add(self, certificate: RoundCertificate) -> None:
        """The certificate of the version just applied."""
        self._certificates = [*self._certificates[1 - self.length :], certificate]
        self._encoded = encode_chain(self._certificates)

    def clear(self) -> None:
        """Forget every certificate (a restarted shard 0: every shard goes back to the same version)."""
        self._certificates, self._encoded = [], b""

    @property
    def encoded(self) -> bytes:
        """The window on the wire (empty before the first async version)."""
        return self._encoded


class FollowerAsync:
    """A follower shard's side of async pushes (see the module docstring).

    Args:
        state: the follower's part of the model.
        key: the run's session key (the certificates' signing key).
        policy: the run's staleness policy (``system.staleness_policy``, ``staleness_beta``, ``max_staleness``).
        shard: this follower's shard (a certificate that names it among ``rolled_back`` passes the version here).
    """

    def __init__(self, state: ModelState, key: bytes, policy: StalenessPolicy, shard: int):
        self.state = state
        self.shard = shard
        self._key = key
        self._weights = policy.with_max_staleness(UNBOUNDED)  # the weight only: shard 0 judges the bound
        self.held: dict[int, OrderedDict[int, tuple[Contribution, float]]] = {}
        """Pushes held here, by worker then request id (oldest first), with their weights."""
        self._forgotten: set[int] = set()  # workers whose momentum was dropped at this version

    def hold(self, base_version: int, contribution: Contribution) -> tuple[int, float]:
        """Hold a worker's slices: ``(staleness, weight)``, its staleness here and the weight it is applied with if
        shard 0 certifies it (the policy's weight, whatever its bound: shard 0 judges the bound, with the
        controller's current one). A retry of a held push is held again, unchanged.

        Raises:
            ShardBehind: ``base_version`` is ahead of this shard's version (it started again from an older
                checkpoint than the worker's parameters).
        """
        if base_version > self.state.version:
            raise ShardBehind(
                f"worker {contribution.worker}: a push on version {base_version}, but this shard holds version "
                f"{self.state.version}"
            )
        staleness = self.state.version - base_version
        weight, _ = self._weights.verdict(staleness)
        pushes = self.held.setdefault(contribution.worker, OrderedDict())
        pushes[contribution.request_id] = (contribution, weight)
        while len(pushes) > HELD_PER_WORKER:
            pushes.popitem(last=False)
        return staleness, weight

    def apply(
        self,
        data: bytes,
        on_version: Callable[[RoundCertificate, float], None] = lambda certificate, weight: None,
        on_forget: Callable[[int, int], None] = lambda version, worker: None,
    ) -> list[tuple[RoundCertificate, float]]:
        """Apply the certified pushes of the chain in ``data`` not applied here yet, in order; each with its weight
        (0.0, and nothing changes but the version, where a certificate says this shard rolled its push back).
        ``on_version(certificate, weight)`` is called after each, ``on_forget(version, worker)`` after a worker's
        momentum is dropped (a follower's events and checkpoints).

        Raises:
            ForgedCertificate: a certificate's signature does not hold, or the chain is malformed.
            ShardBehind: a certified push is not held here, or the chain starts past this shard's next version.
        """
        applied = []
        for certificate in decode_chain(data):
            check_signature(self._key, certificate)
            if all(request == FORGET for _, request in certificate.contributors):
                self._forget(certificate, on_forget)
                continue
            if certificate.version <= self.state.version:
                continue
            if certificate.version != self.state.version + 1:
                raise ShardBehind(
                    f"certificate of version {certificate.version}, but this shard holds version {self.state.version}"
                )
            if len(certificate.contributors) != 1:
                raise ForgedCertificate(f"the async certificate of version {certificate.version} names several pushes")
            ((worker, request),) = certificate.contributors
            held = self.held.get(worker, {})
            if request not in held:
                raise ShardBehind(
                    f"version {certificate.version}: the certified push {request} of worker {worker} is not held here"
                )
            contribution, weight = held[request]
            while held:  # this push and the worker's older ones (rejected elsewhere, or lost) go
                if held.popitem(last=False)[0] == request:
                    break
            self.state.set_learning_rate(certificate.learning_rate)
            if certificate.rolls_back(self.shard):  # too stale here: the version passes, the others apply it
                weight = 0.0
                self.state.pass_version()
            else:
                self.state.step(contribution.gradients, contribution.buffers, weight, worker=worker)
            self._forgotten.clear()
            applied.append((certificate, weight))
            on_version(certificate, weight)
        return applied

    def _forget(self, certificate: RoundCertificate, on_forget: Callable[[int, int], None]) -> None:
        """Drop the momentum of the workers ``certificate`` names, once, at its version (shard 0 dropped it there:
        after that version's push, before the next one)."""
        if certificate.version < self.state.version:
            return  # passed already: the chains carry it before any later version
        if certificate.version > self.state.version:
            raise ShardBehind(
                f"a certificate at version {certificate.version}, but this shard holds version {self.state.version}"
            )
        for worker, _ in certificate.contributors:
            if worker not in self._forgotten:
                self._forgotten.add(worker)
                self.state.forget_worker(worker)
                on_forget(certificate.version, worker)
