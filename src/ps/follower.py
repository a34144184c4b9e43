"""A follower shard's server logic, with no transport in it: holds workers' slices, applies what shard 0 certified.

With the server split across ``system.num_servers`` shards (:mod:`src.ps.placement`), shard ``k > 0`` serves its
part of the model (:func:`~src.ps.shard_model.shard_module`) and decides nothing of its own: shard 0 registers
the workers, plans their work and closes each sync barrier (:class:`~src.ps.core.ServerCore`). A follower

* checks each call's session by its signature (:class:`~src.ps.shard_sessions.ShardSessions`), with no round
  trip to shard 0;
* holds a worker's push (``PushRequest.hold``) decoded and checked against its own layout, as any server
  decodes a push (:class:`~src.ps.push_decode.ModelLayout`), and acknowledges it;
* on a pull that carries shard 0's certificate of the next version, applies that version from exactly the
  certified pushes (:class:`~src.ps.shard_rounds.FollowerRounds`), then replies with its slices.

The protocol and why it keeps every shard's version made of the same pushes: :mod:`src.ps.shard_rounds`.

How a driver calls it: every method takes :attr:`FollowerCore.lock` itself (a follower never waits for
anything: what a certificate names was held before shard 0 could sign it), except :meth:`FollowerCore.decode`,
which only reads the layout. Refusals are :class:`~src.ps.refusals.Refused` with gRPC's status names, as the
server core's. Outputs under ``system.log_dir/server_K``: ``events.jsonl`` (``run_start`` with the shard's slices
and bytes, ``hold``, ``update`` with the certified pushes, ``push_refused``).
"""

from __future__ import annotations

import threading
from pathlib import Path

from torch import nn

from src import parameter_server_pb2 as pb
from src.common.clock import REAL_CLOCK, Clock
from src.common.sessions import SessionSigner
from src.config import Config
from src.coordinator import MembershipError
from src.metrics import MetricsLogger
from src.ps.aggregation import Contribution
from src.ps.model import ServedModel
from src.ps.placement import Placement
from src.ps.refusals import MEMBERSHIP_CODES, Refused
from src.ps.shard_model import shard_module
from src.ps.shard_rounds import FollowerRounds, ForgedCertificate, RoundCertificate, ShardBehind
from src.ps.shard_sessions import ShardSessions
from src.transport.wire import Pieces, Received


class FollowerCore:
    """The run state of follower shard ``shard`` (see the module docstring).

    Args:
        config: the run's config (optimizer, workers, outputs).
        model: the whole model at its initial values (every shard builds the same one).
        placement: the run's placement (every process computes the same one).
        shard: this shard's index, ``1 .. placement.num_shards - 1``.
        key: the run's session key (:func:`~src.common.sessions.session_key`).
        clock: where event times come from.
        reply_views: replies as :class:`~src.transport.wire.Pieces` over the tensors (as the server core's).
    """

    def __init__(
        self,
        config: Config,
        *,
        model: nn.Module,
        placement: Placement,
        shard: int,
        key: bytes,
        clock: Clock = REAL_CLOCK,
        reply_views: bool = False,
    ):
        if not 0 < shard < placement.num_shards:
            raise ValueError(f"shard {shard}: a follower is one of shards 1..{placement.num_shards - 1}")
        self.config = config
        self.shard = shard
        self.lock = threading.Lock()
        self.model = ServedModel(config, reply_views=reply_views)
        self.model.install(shard_module(model, placement, shard))
        self.rounds = FollowerRounds(self.model.state, key)
        self.sessions = ShardSessions(SessionSigner(key), config.system.num_workers)
        self.log = MetricsLogger(
            Path(config.system.log_dir) / f"server_{shard}", tensorboard=False, role=f"server_{shard}", clock=clock.time
        )
        self.log.event(
            "run_start",
            architecture="parameter_server",
            shard=shard,
            num_servers=placement.num_shards,
            slices=[piece.key for piece in placement.on_shard(shard)],
            bytes=placement.bytes_per_shard()[shard],
            version=self.version,
        )

    version = property(lambda self: self.model.state.version, doc="This shard's version (shard 0's, or one behind).")
    state = property(lambda self: self.model.state, doc="This shard's slices and their optimizer.")

    def member(self, caller: pb.Caller) -> int:
        """The worker id behind ``caller``, whose session holds; refuses the call otherwise."""
        try:
            with self.lock:
                self.sessions.check(caller.worker_id, caller.session)
        except MembershipError as exc:
            raise Refused(MEMBERSHIP_CODES[exc.kind], exc.message) from None
        return caller.worker_id

    def decode(self, worker_id: int, received: Received) -> Contribution:
        """Check and decompress a held push's slices against this shard's layout (no lock needed).

        Raises:
            Refused: not a held push (INVALID_ARGUMENT), or tensors that do not fit the layout.
        """
        if not received.message.hold:
            raise Refused("INVALID_ARGUMENT", f"shard {self.shard} takes held pushes only (PushRequest.hold)")
        return self.model.layout.decode(worker_id, received, owns_data=False)

    def hold(self, worker_id: int, request: pb.PushRequest, contribution: Contribution) -> bytes:
        """Hold a decoded push for the version after ``request.base_version``; the acknowledgement's bytes.

        Raises:
            Refused: not for this shard's next version, or another push of the worker is held for it
                (FAILED_PRECONDITION).
        """
        with self.lock:
            try:
                new = self.rounds.hold(request.base_version + 1, contribution)
            except ValueError as exc:
                raise Refused("FAILED_PRECONDITION", f"shard {self.shard}: {exc}") from None
            if new:
                self.log.event(
                    "hold",
                    worker=worker_id,
                    request_id=request.request_id,
                    base_version=request.base_version,
                    num_samples=request.num_samples,
                    batch_ids=list(request.batch_ids),
                )
            return pb.PushReply(accepted=True, version=self.version).SerializeToString()

    def pull(self, worker_id: int, request: pb.PullRequest) -> bytes | Pieces:
        """Apply the version ``request.certificate`` names (if it is not applied yet), then the slices' reply.

        Raises:
            Refused: a forged or malformed certificate (PERMISSION_DENIED), or one this shard cannot apply
                (ShardBehind: FAILED_PRECONDITION).
        """
        with self.lock:
            if request.certificate:
                self._apply(request.certificate)
            return self.model.replies.serialize(pb.PullReply(version=self.version), worker_id)

    def _apply(self, data: bytes) -> None:
        try:
            certificate = RoundCertificate.decode(data)
            applied = self.rounds.apply(certificate)
        except ForgedCertificate as exc:
            raise Refused("PERMISSION_DENIED", f"shard {self.shard}: {exc}") from None
        except ShardBehind as exc:
            raise Refused("FAILED_PRECONDITION", f"shard {self.shard}: {exc}") from None
        if applied:
            self.log.event(
                "update",
                version=self.version,
                requests=[list(pair) for pair in certificate.contributors],
                learning_rate=certificate.learning_rate,
            )

    def close(self) -> None:
        """Close the event log."""
        self.log.close()
