"""A follower shard's server logic, with no transport in it: holds workers' slices, applies what shard 0 certified.

With the server split across ``system.num_servers`` shards (:mod:`src.ps.shards.placement`), shard ``k > 0`` serves its
part of the model (:func:`~src.ps.shards.parts.shard_module`) and decides nothing of its own: shard 0 registers
the workers, plans their work and closes each sync barrier (:class:`~src.ps.server.core.ServerCore`). A follower

* checks each call's session by its signature (:class:`~src.ps.shards.sessions.ShardSessions`), with no round
  trip to shard 0;
* holds a worker's push (``PushRequest.hold``) decoded and checked against its own layout, as any server
  decodes a push (:class:`~src.ps.state.decoding.ModelLayout`), and acknowledges it;
* on a pull that carries shard 0's certificate of the next version, applies that version from exactly the
  certified pushes (:class:`~src.ps.shards.rounds.FollowerRounds`), then replies with its slices.

The protocol and why it keeps every shard's version made of the same pushes: :mod:`src.ps.shards.rounds`.

How a driver calls it: every method takes :attr:`FollowerCore.lock` itself (a follower never waits for
anything: what a certificate names was held before shard 0 could sign it), except :meth:`FollowerCore.decode`,
which only reads the layout. Refusals are :class:`~src.ps.state.refusals.Refused` with gRPC's status names, as the
server core's. Outputs under ``system.log_dir/server_K``: ``events.jsonl`` (``run_start`` with the shard's slices,
bytes and pid, ``hold``, ``update`` with the certified pushes, ``checkpoint``, ``shard_recovered``); checkpoints
(its part, its optimizer, its version) in ``system.checkpoint_dir/shard_K`` at version 0 and every
``training.checkpoint_interval`` versions, at the versions shard 0 writes its own, so the shards of a run always
share a recent version to go back to together (the launcher's recovery of a shard that died).
"""

from __future__ import annotations

import copy
import os
import secrets
import threading
import time
from functools import partial
from pathlib import Path

from torch import nn

from src import parameter_server_pb2 as pb
from src.common.checkpoint import (
    KEEP_CHECKPOINTS,
    CheckpointError,
    load_latest_good,
    make_checkpoint,
    numbered_checkpoints,
    numbered_path,
    prune_checkpoints,
    save_checkpoint,
)
from src.common.clock import REAL_CLOCK, Clock
from src.common.sessions import SessionSigner
from src.config import Config
from src.coordinator import MembershipError
from src.metrics import MetricsLogger
from src.ps.shards.asynchronous import FollowerAsync
from src.ps.shards.parts import shard_module
from src.ps.shards.placement import Placement
from src.ps.shards.rounds import FollowerRounds, ForgedCertificate, RoundCertificate, ShardBehind
from src.ps.shards.sessions import ShardSessions
from src.ps.state.aggregation import Contribution
from src.ps.state.refusals import MEMBERSHIP_CODES
from src.ps.state.served_model import ServedModel
from src.ps.state.slice_pipeline import SlicePipeline, slice_elements_of
from src.ps.state.staleness import StalenessPolicy
from src.transport.errors import Refused
from src.transport.sinks import Sink
from src.transport.wire import Pieces, Received


def shard_checkpoint_dir(checkpoint_dir: str | Path, shard: int) -> Path:
    """Where follower shard ``shard`` keeps its numbered checkpoints in the run's ``checkpoint_dir``."""
    return Path(checkpoint_dir) / f"shard_{shard}"


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
        resume: continue from this shard's checkpoint (a file, or a folder: see :meth:`_restore`); otherwise a
            checkpoint of version 0 is written first, so every shard has one version to go back to.
        recovering: start again across hosts: restore nothing yet and refuse calls (UNAVAILABLE: clients retry)
            until :meth:`go_back_to` the version shard 0 chooses.
        pid: the process id its ``run_start`` says (default this process's; a simulated shard has its own).
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
        resume: str | Path | None = None,
        recovering: bool = False,
        pid: int | None = None,
    ):
        if not 0 < shard < placement.num_shards:
            raise ValueError(f"shard {shard}: a follower is one of shards 1..{placement.num_shards - 1}")
        self.config = config
        self.shard = shard
        self.lock = threading.Lock()
        self.model = ServedModel(config, reply_views=reply_views)
        self.model.install(shard_module(model, placement, shard))
        self.asynchronous = config.system.aggregation_mode == "async"
        self.rounds = FollowerRounds(self.model.state, key)
        self.pipeline: SlicePipeline | None = None
        """system.pipelined_replies (sync): provisional slices of each round's holds
        (:mod:`src.ps.state.slice_pipeline`), whose workers are guessed from the last certificate (see
        :meth:`_open_round`)."""
        if config.system.pipelined_replies and not self.asynchronous:
            self.pipeline = SlicePipeline(self.model.state, slice_elements_of(config.system.pipeline_slice_bytes))
        self.pushes = FollowerAsync(self.model.state, key, StalenessPolicy.from_config(config.system), shard)
        self.sessions = ShardSessions(SessionSigner(key), config.system.num_workers)
        self.checkpoint_dir = shard_checkpoint_dir(config.system.checkpoint_dir, shard)
        self.load = pb.ShardLoad()
        """What this shard has carried (the bytes of the messages in and out, counted by its driver) and its
        optimizer's seconds: its Status reply's ``load``, which shard 0 puts in the run summary."""
        self.log = MetricsLogger(
            Path(config.system.log_dir) / f"server_{shard}", tensorboard=False, role=f"server_{shard}", clock=clock.time
        )
        self.run_over = threading.Event()
        """Set once shard 0 has read this shard's part at the end of the run (``PullRequest.final``)."""
        self.instance = secrets.token_bytes(8)
        """Random per process: shard 0 and the other shards notice this shard started again by its change."""
        self.ready = not recovering
        resumed_from = self._restore(resume) if resume is not None else None
        self.log.event(
            "run_start",
            architecture="parameter_server",
            shard=shard,
            num_servers=placement.num_shards,
            slices=[piece.key for piece in placement.on_shard(shard)],
            bytes=placement.bytes_per_shard()[shard],
            version=self.version,
            pid=pid if pid is not None else os.getpid(),
            resumed_from=str(resumed_from) if resumed_from else None,
        )
        if resumed_from is None and not recovering:
            self._checkpoint()  # version 0: a point every shard of the run can go back to

    version = property(lambda self: self.model.state.version, doc="This shard's version (shard 0's, or one behind).")
    state = property(lambda self: self.model.state, doc="This shard's slices and their optimizer.")

    def checkpoint_versions(self) -> list[int]:
        """The versions of this shard's numbered checkpoints, newest first."""
        return [int(path.stem.rsplit("_", 1)[1]) for path in numbered_checkpoints(self.checkpoint_dir)]

    def go_back_to(self, version: int | None) -> None:
        """A shard starting again across hosts (``recovering``): take up its checkpoint of ``version``, the one
        shard 0 chose for every shard (:func:`src.ps.shards.recovery.choose_version`), and serve; ``None``: shard 0
        started afresh, and so does this shard (its checkpoint of version 0 first)."""
        with self.lock:
            if version is None:
                self._checkpoint()
            else:
                self._restore(numbered_path(self.checkpoint_dir, version))
            self.ready = True

    def _check_ready(self) -> None:
        if not self.ready:
            raise Refused(
                "UNAVAILABLE",
                f"shard {self.shard} is starting again: it waits for shard 0 to say which version the shards go "
                f"back to",
            )

    def member(self, caller: pb.Caller) -> int:
        """The worker id behind ``caller``, whose session holds; refuses the call otherwise."""
        try:
            with self.lock:
                self._check_ready()
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
            if self.asynchronous:
                return self._hold_async(worker_id, request, contribution)
            try:
                new = self.rounds.hold(request.base_version + 1, contribution)
            except ValueError as exc:
                raise Refused("FAILED_PRECONDITION", f"shard {self.shard}: {exc}") from None
            if new:
                self._log_hold(worker_id, request)
            return pb.PushReply(accepted=True, version=self.version).SerializeToString()

    def _hold_async(self, worker_id: int, request: pb.PushRequest, contribution: Contribution) -> bytes:
        """An async push: held with its staleness against this shard's version (:mod:`src.ps.shards.asynchronous`)."""
        try:
            staleness, weight = self.pushes.hold(request.base_version, contribution)
        except ShardBehind as exc:
            raise Refused("FAILED_PRECONDITION", f"shard {self.shard}: {exc}") from None
        self._log_hold(worker_id, request, staleness=staleness, weight=weight)
        return pb.PushReply(accepted=True, version=self.version, staleness=staleness, weight=weight).SerializeToString()

    def _log_hold(self, worker_id: int, request: pb.PushRequest, **verdict) -> None:
        self.log.event(
            "hold",
            worker=worker_id,
            request_id=request.request_id,
            base_version=request.base_version,
            num_samples=request.num_samples,
            batch_ids=list(request.batch_ids),
            **verdict,
        )

    def pull(self, worker_id: int, request: pb.PullRequest, sink: Sink | None = None) -> bytes | Pieces:
        """Apply the version ``request.certificate`` names (if it is not applied yet), then the slices' reply.
        ``sink``: the connection it goes on (``system.pipelined_replies``): the slices of this worker's hold
        confirmed by the step are left out (``PullReply.provisional``), since it holds them.

        Raises:
            Refused: a forged or malformed certificate (PERMISSION_DENIED), or one this shard cannot apply
                (ShardBehind: FAILED_PRECONDITION).
        """
        with self.lock:
            if request.certificate:
                self._apply(request.certificate)
            omit = self._omitted(sink)
            message = pb.PullReply(version=self.version, provisional=omit)
            reply = self.model.replies.serialize(message, worker_id, omit=omit)
            if request.final:
                self.run_over.set()
            return reply

    def attach(self, worker_id: int, sink: Sink | None) -> None:
        """``worker_id``'s holds come on ``sink``'s connection now (``system.pipelined_replies``): its next hold's
        values are reported there (:meth:`SlicePipeline.attach <src.ps.state.slice_pipeline.SlicePipeline.attach>`)."""
        if self.pipeline is not None and sink is not None:
            self.pipeline.attach(worker_id, sink)

    def arriving(self, sink: Sink | None):
        """What a streamed hold's parts on ``sink`` report their values to (``None``: nothing: no pipelining, or
        a connection no hold has come on yet)."""
        if self.pipeline is None or sink is None or sink.worker is None:
            return None
        return partial(self.pipeline.arrived, sink)

    def _omitted(self, sink: Sink | None) -> list[int]:
        if self.pipeline is None:
            return []
        omit = self.pipeline.omitted_logged(sink, self.log)
        counts = self.pipeline.counts
        load = self.load
        load.slices_sent, load.slices_confirmed = counts["slices_sent"], counts["slices_confirmed"]
        load.slices_voided, load.tensors_omitted = counts["slices_voided"], counts["tensors_omitted"]
        return omit

    def _open_round(self, certificate: RoundCertificate, samples: dict[int, int]) -> None:
        """``system.pipelined_replies``: the next round's holds are stepped slice by slice as they arrive, for the
        workers of the round just applied with their samples (a guess: only shard 0 knows the round's workers, and
        only its certificate, after the holds, names them; a wrong guess only voids slices at the comparison)."""
        if self.pipeline is not None:
            self.pipeline.open_round(certificate.version, samples)

    def _apply(self, data: bytes) -> None:
        started = time.perf_counter()
        try:
            if self.asynchronous:
                applied = self.pushes.apply(data, on_version=self._applied, on_forget=self._forgot)
            else:
                certificate = RoundCertificate.decode(data)
                held = {worker: c.num_samples for worker, c in self.rounds.held.items()}
                applied = [(certificate, 1.0)] if self.rounds.apply(certificate) else []
                if applied:
                    self._applied(certificate, 1.0)
                    self._open_round(certificate, {w: held[w] for w, _ in certificate.contributors})
        except ForgedCertificate as exc:
            raise Refused("PERMISSION_DENIED", f"shard {self.shard}: {exc}") from None
        except ShardBehind as exc:
            raise Refused("FAILED_PRECONDITION", f"shard {self.shard}: {exc}") from None
        if applied:
            self.load.update_s += time.perf_counter() - started

    def _applied(self, certificate: RoundCertificate, weight: float) -> None:
        """The version ``certificate`` names is applied (or passed: rolled back here): its event, and a checkpoint at
        shard 0's versions."""
        rolled_back = certificate.rolls_back(self.shard)
        self.load.rolled_back += rolled_back
        self.log.event(
            "update",
            version=self.version,
            requests=[list(pair) for pair in certificate.contributors],
            learning_rate=certificate.learning_rate,
            **({"weight": weight} if self.asynchronous else {}),
            **({"rolled_back": True} if rolled_back else {}),
        )
        if self.version % self.config.training.checkpoint_interval == 0:
            self._checkpoint()  # before the next version: at the versions shard 0 writes its own

    def _forgot(self, version: int, worker: int) -> None:
        self.log.event("momentum_dropped", version=version, worker=worker)

    def part_checkpoint(self, *, optimizer: bool = False) -> dict:
        """This shard's part of the model in the common format (lock held): the part's ``state_dict`` (slice key ->
        flat tensor), ``step`` = its version, and with ``optimizer`` its optimizer's state (to resume from)."""
        state = self.model.state
        t = self.config.training
        return make_checkpoint(
            model_state_dict=state.model.state_dict(),
            optimizer_state_dict=copy.deepcopy(state.optimizer.state_dict()) if optimizer else None,
            model_architecture=t.model_architecture,
            dataset=t.dataset,
            epoch=0,
            step=state.version,
            config=self.config.to_dict(),
            extra={"shard": self.shard, "version": state.version},
        )

    def _checkpoint(self) -> Path:
        """Write this shard's part, optimizer and version as ``shard_K/checkpoint_<version>.pt`` (lock held or
        at start) and keep the newest few, as shard 0 keeps its own."""
        version = self.model.state.version
        path = save_checkpoint(numbered_path(self.checkpoint_dir, version), self.part_checkpoint(optimizer=True))
        prune_checkpoints(self.checkpoint_dir, KEEP_CHECKPOINTS)
        self.log.event("checkpoint", path=str(path), version=version)
        return path

    def _restore(self, target: str | Path) -> Path:
        """Continue from a checkpoint of this shard: a file, or a folder (this shard's own, or the run's
        ``checkpoint_dir``, where this shard's are in ``shard_K/``)."""
        target = Path(target)
        if target.is_dir() and not numbered_checkpoints(target):
            target = shard_checkpoint_dir(target, self.shard)
        path, checkpoint = load_latest_good(target)
        if checkpoint["extra"].get("shard") != self.shard:
            raise CheckpointError(f"--resume {path}: not a checkpoint of parameter-server shard {self.shard}")
        state = self.model.state
        try:
            state.model.load_state_dict(checkpoint["model_state_dict"])
        except RuntimeError as exc:
            raise CheckpointError(f"--resume {path}: its slices are not this shard's ({exc})") from None
        state.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        state.version = checkpoint["extra"]["version"]
        self.log.event("shard_recovered", checkpoint=str(path), version=state.version)
        return path

    def close(self) -> None:
        """Close the event log."""
        self.log.close()
