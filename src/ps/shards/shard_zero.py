"""Shard 0's part in a sharded parameter server: what its server core does differently from an unsharded one.

With ``S > 1`` shards (:mod:`src.ps.shards.placement`), shard 0's :class:`~src.ps.server.core.ServerCore` serves its
part of the model (:func:`~src.ps.shards.parts.shard_module`), signs the sessions it issues so that every shard checks
them alone (:mod:`src.common.sessions`), takes a worker's push in two calls (held, then committed once every shard holds
its slices) and signs a certificate of each sync version for the followers (:mod:`src.ps.shards.rounds`).
:class:`Sharding` is that role's settings and checks; the core calls it.

Async pushes are applied on the shards that accept their staleness and rolled back on the others, in shard 0's
order (:mod:`src.ps.shards.asynchronous`).

What a sharded run does not do yet (:meth:`Sharding.refusal` says which, in one line): a model that a worker
brings (Initialize), evaluation on the server (shard 0 holds a part of the model), downlink compression.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from src import parameter_server_pb2 as pb
from src.common.sessions import session_key
from src.ps.shards.parts import model_placement, shard_module
from src.ps.shards.placement import Placement
from src.ps.shards.rounds import RoundCertificate, certify
from src.transport.errors import PushRefused


@dataclass(frozen=True)
class Sharding:
    """Shard 0 of a server split by ``placement``; ``key``: the run's session key, which signs sessions and
    certificates (:func:`~src.common.sessions.session_key`)."""

    placement: Placement
    key: bytes

    @classmethod
    def of_run(cls, model: nn.Module, system: Any, token: str) -> Sharding:
        """What every process of a run computes alike: the placement of ``model`` over ``system.num_servers``
        shards with ``system.shard_slice_bytes`` slices, and the session key from the run's auth token."""
        placement = model_placement(model, system.num_servers, system.shard_slice_bytes)
        return cls(placement, session_key(token.encode()))

    def refusal(self, config: Any, model: nn.Module | None, test_set: Any) -> str | None:
        """Why this role cannot serve the run of ``config`` (a :class:`~src.config.Config`, not imported: the config's
        module reaches processes) yet, in one line (``None``: it can)."""
        system = config.system
        refusals = [
            (model is None, "a sharded server needs its model at start (a worker's Initialize is not sharded)"),
            (test_set is not None, "a sharded server does not evaluate (shard 0 holds a part of the model)"),
            (system.downlink_compression != "none", "system.downlink_compression: not with a sharded server so far"),
        ]
        return next((message for refused, message in refusals if refused), None)

    def part(self, model: nn.Module) -> nn.Module:
        """Shard 0's part of ``model``."""
        return shard_module(model, self.placement, 0)

    def certify(
        self,
        version: int,
        pushes: list[tuple[int, int]],
        learning_rate: float,
        rolled_back: tuple[int, ...] | None = None,
    ) -> RoundCertificate:
        """The signed certificate of version ``version`` (async: with ``rolled_back``, the shards its push is not
        applied on, maybe none; ``None``: a sync version's)."""
        return certify(self.key, version, pushes, learning_rate, rolled_back)

    @staticmethod
    def check_push(sharding: Sharding | None, request: pb.PushRequest) -> None:
        """Refuse a push a server of this kind does not take: a hold or commit to an unsharded server, a plain push
        (or one both held and committed) to a sharded one."""
        if sharding is None:
            raise PushRefused(
                "INVALID_ARGUMENT", "push: hold and commit are for a sharded server (system.num_servers > 1)"
            )
        if request.hold == request.commit:
            raise PushRefused(
                "INVALID_ARGUMENT",
                "push: a sharded server takes a push in two calls, hold=true with the tensors, then commit=true",
            )

    def check_staleness(self, request: pb.PushRequest, mode: str) -> None:
        """Refuse a commit whose followers' staleness does not fit ``mode``: async, every follower's; sync, none."""
        shards = sorted(entry.shard for entry in request.shard_staleness)
        expected = list(range(1, self.placement.num_shards)) if mode == "async" else []
        if shards != expected:
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"commit of push {request.request_id}: the staleness of shards {shards}, but "
                + (
                    f"an async commit carries every follower's (shards 1..{len(expected)})"
                    if expected
                    else "a sync one none"
                ),
            )
