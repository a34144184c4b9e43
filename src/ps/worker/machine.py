"""The worker's step machine: what a parameter-server worker sends next, and what it does with what comes back.

The worker-side twin of the server core (:class:`~src.ps.server.core.ServerCore`): no I/O, no clock. Every worker
drives one: the process worker (:mod:`src.worker`: calls on threads, the wall clock), the simulated worker of a
virtual-time run (:mod:`src.virtual.worker`: events, the cost model's clock) and the library
(:mod:`src.torch_asgc`: the user's loop). Each only moves the calls an exchange yields and keeps time
(:mod:`src.ps.worker.calls`); every protocol decision is here, so a worker-side behaviour lands once, and virtual time
runs the worker users run.

What :class:`StepMachine` holds: the worker's :class:`~src.ps.worker.membership.Membership` (incarnation, session,
rejoin budget), its :class:`~src.ps.worker.codec.PushCodec` (compression, error feedback), the version of the
parameters it holds (a sharded server's: of each shard's slices), the batches it carries after a rejected push, its
request ids and its running totals. What it does:

* **pull** (:meth:`~StepMachine.pull_everything`; the first: :meth:`~StepMachine.start`): the parameters and work
  from the server; a sharded server's shard 0 first (its slices, the buffers, the work, the certificate), then every
  other shard's slices at once (async: with the certificate's window), all of one version (else a shard is starting
  again: register again and pull again);
* **push** (:meth:`~StepMachine.push`), whole or streamed: one server takes the push; a sharded server takes a
  *hold* of its slices on every shard at once, then the tensor-free *commit* to shard 0 once every shard acknowledged
  (async: with each follower's staleness), whose reply carries the verdict, the next work and the certificate, then
  every shard's slices are pulled at once (the followers' after applying the certificate's version);
* **settle** (:meth:`~StepMachine.settle`): the verdict commits the residuals or rolls them back (async sharded: per
  shard, where that shard rolled the push back), a rejected push's batches are carried into the next push, the
  reply's parameters are loaded and the step counted (totals, the ``push`` event, the scalars);
* **a failed call** (:meth:`~StepMachine.rejoin`): lost with the server's session or revoked, register again and
  settle the push in flight by what the registration says (applied: commit; not, after a lost session, discard when
  the server hands its samples out again, else roll back into the residual), then pull; a shard that fails a call
  means the shards are starting again: register again with shard 0 as after a lost session;
* **finish** (:meth:`~StepMachine.finish`): tell the server this worker is done (after a failure: register again, and
  a worker on planned work pulls what the restarted server hands out).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from src import parameter_server_pb2 as pb
from src.metrics import LOG_EVERY_STEPS, MetricsLogger
from src.ps.shards.placement import Placement
from src.ps.worker.calls import FINISH, INITIALIZE, PULL, PUSH, Call, Exchange, failure_in
from src.ps.worker.codec import PushCodec, controlled_policy
from src.ps.worker.loading import load_reply, load_shard_reply
from src.ps.worker.membership import Failure, Membership
from src.transport.errors import CallError
from src.transport.wire import Received, tensor_view

logger = logging.getLogger(__name__)

PER_PROCESS_STATS = ("train_loss", "train_accuracy")
"""WorkerStats fields that describe the process so far; the others count from the incarnation's registration."""
COUNTS = ("samples", "steps", "steps_skipped", "pushes_rejected", "payload_bytes", "dense_bytes")
SECONDS = ("gradient_time_s", "compression_time_s", "communication_time_s", "train_loss", "train_accuracy")


def holds(request: pb.PushRequest, versions: Sequence[int]) -> list[pb.PushRequest]:
    """``request``'s hold to each shard (``hold``; the tensors go with the call), based on ``versions[k]``, the version
    of shard ``k``'s slices the worker computed on (sync: all the same; async: each shard's own, which the shard's
    staleness is counted from)."""
    held = []
    for version in versions:
        message = pb.PushRequest()
        message.CopyFrom(request)
        message.hold = True
        message.base_version = version
        held.append(message)
    return held


def commit(request: pb.PushRequest, acks: Sequence[Any], base_version: int, mode: str) -> pb.PushRequest:
    """The tensor-free commit of ``request`` to shard 0 (based on ``base_version``, its slices' version) once every
    shard acknowledged its hold (``acks``, in shard order: messages, or as received); async: with each follower's
    staleness."""
    message = pb.PushRequest()
    message.CopyFrom(request)
    message.commit = True
    message.base_version = base_version
    if mode == "async":
        for shard, ack in enumerate(acks[1:], start=1):
            staleness = (ack.message if isinstance(ack, Received) else ack).staleness
            message.shard_staleness.add(shard=shard, staleness=staleness)
    return message


def applied_on(reply: pb.PushReply, shard: int) -> bool:
    """Whether shard ``shard`` applied the push ``reply`` (one server's reply, or shard 0's commit reply) answers: it
    was accepted, and not rolled back there (async: a shard where its staleness was over the bound rolls its slices
    back, and the worker rolls back their residuals, while the others apply theirs: :mod:`src.ps.shards.asynchronous`).
    """
    return reply.accepted and shard not in reply.rolled_back


@dataclass(frozen=True)
class Rejoined:
    """A push (or a Finish) lost with the server's session or this incarnation: the worker registered again, settled
    it by what the registration said, and pulled: ``work`` is that pull's reply."""

    work: Received


@dataclass(frozen=True)
class StepFigures:
    """What a driver measured of one settled step: seconds (its clock's) and bytes (as its transport counts them)."""

    gradient_time_s: float
    compression_time_s: float
    communication_time_s: float
    payload_bytes: int
    push_bytes: int
    reply_bytes: int
    bytes_sent: int
    bytes_received: int

    @classmethod
    def of(
        cls, seconds: Sequence[float], payload_bytes: int, traffic: Sequence[tuple[int, int]], totals: Sequence[int]
    ) -> StepFigures:
        """Gradient, compression and communication ``seconds``, the push's ``traffic`` (sent and received bytes of
        each of its calls) and the process's ``totals`` (bytes sent and received so far)."""
        sent, received = sum(s for s, _ in traffic), sum(r for _, r in traffic)
        return cls(*seconds, payload_bytes, sent, received, *totals)


class StepMachine:
    """One worker's side of the protocol (see the module docstring).

    Args:
        membership: who the worker is to the server (registered once already).
        system: the run's system config (the server's: aggregation mode, shards).
        params: the tensors replies load the parameters into (the model's, or a simulated worker's replica), in the
            served order; ``names``: theirs.
        buffers: the float buffers replies load, in the served order; ``buffer_names``: theirs.
        placement: a sharded server's: the model over its shards (``None``: one server).
        codec: the push codec (``None``: set it before the first push, as the library's optimizer does).
        planned_work: the server hands out the batches (a lost push's samples are computed again, from the work it
            hands out after the worker registers again); ``False``: the worker's own loop picks them (the library).
        log: the worker's event log (``None``: no events).
        stats: what the driver reports now (:meth:`stats` with its figures), taken when a revoked incarnation ends.
        request_ids: where request ids start (default: a random 62-bit number, so that a restarted worker's ids do
            not collide with its predecessor's).
    """

    def __init__(
        self,
        membership: Membership,
        system: Any,
        *,
        names: Sequence[str] = (),
        params: Sequence[torch.Tensor] = (),
        buffer_names: Sequence[str] = (),
        buffers: Sequence[torch.Tensor] = (),
        placement: Placement | None = None,
        codec: PushCodec | None = None,
        planned_work: bool = True,
        log: MetricsLogger | None = None,
        stats: Callable[[], pb.WorkerStats] | None = None,
        request_ids: int | None = None,
    ):
        self.membership = membership
        self.mode = system.aggregation_mode
        self.attach(names, params, buffer_names, buffers, placement)
        self.codec = codec
        self.planned_work = planned_work
        self.log = log
        self.driver_stats = stats
        self.request_id = request_ids if request_ids is not None else (random.SystemRandom().getrandbits(62) or 1)
        self.carried: list[pb.Batch] = []  # batches whose rejected gradient waits in the error feedback
        self.version = 0
        self.totals: dict[str, Any] = {**dict.fromkeys(COUNTS, 0), **dict.fromkeys(SECONDS, 0.0)}
        self.last_communication_s = 0.0
        self.finished_stats: pb.WorkerStats | None = None  # what the accepted Finish reported
        self._earlier: dict[str, float] = {}  # what this process reported for its earlier incarnations
        self._epoch = [0.0, 0, 0]  # loss * samples, correct, samples so far
        self._step: tuple = ([], [], None, 0, 0)  # the push in flight's batches, batch ids, loss, correct, samples

    def attach(
        self,
        names: Sequence[str],
        params: Sequence[torch.Tensor],
        buffer_names: Sequence[str],
        buffers: Sequence[torch.Tensor],
        placement: Placement | None = None,
    ) -> None:
        """The tensors replies load (the library's model, known after the registration); see the class's Args."""
        self.names, self.params = list(names), list(params)
        self._index = {name: index for index, name in enumerate(self.names)}
        self.buffer_names, self.buffers = list(buffer_names), list(buffers)
        self.placement = placement
        self.shard_versions = [0] * (placement.num_shards if placement is not None else 1)
        self.dense_bytes_per_step = 4 * sum(p.numel() for p in self.params)  # what identity payloads carry

    @property
    def num_shards(self) -> int:
        return len(self.shard_versions)

    @property
    def caller(self) -> pb.Caller:
        return self.membership.caller

    # ------------------------------------------------------------------------- the push's messages

    def encode(self, named_gradients: Any) -> list[list[Any]]:
        """Each shard's payloads (one server: ``[payloads]``) of ``(name, gradient)`` pairs in the served order."""
        return self.codec.encode(named_gradients, self.totals["steps"])

    def encode_part(self, shard: int, position: int, gradient_of: Callable[[int], torch.Tensor]) -> Any:
        """A streamed push's part: shard ``shard``'s slice ``position`` (one server: tensor ``position``), cut from
        ``gradient_of(index)``, its whole tensor's gradient (:meth:`PushCodec.encode_slice
        <src.ps.worker.codec.PushCodec.encode_slice>`)."""
        index = position if self.placement is None else self._index[self.placement.on_shard(shard)[position].name]
        return self.codec.encode_slice(shard, position, gradient_of(index), self.totals["steps"])

    def request(
        self,
        batches: Sequence[pb.Batch] = (),
        *,
        samples: int | None = None,
        loss: float | None = None,
        correct: int = 0,
        gradient_time_s: float = 0.0,
        compression_time_s: float = 0.0,
        learning_rate: float | None = None,
    ) -> pb.PushRequest:
        """The next push (a new request id), covering the carried and the new ``batches`` (the server's planned work)
        or ``samples`` (the worker's own loop); ``loss`` and ``correct`` describe the step (``None``: unknown)."""
        self.request_id += 1
        covered = self.carried + list(batches)
        samples = sum(len(b.indices) for b in batches) if samples is None else samples
        self._step = (list(batches), [b.batch_id for b in covered], loss, correct, samples)
        return pb.PushRequest(
            caller=self.caller,
            base_version=self.version,
            request_id=self.request_id,
            num_samples=sum(len(b.indices) for b in covered) if batches or self.carried else samples,
            batch_ids=[b.batch_id for b in covered],
            learning_rate=learning_rate,
            metrics=pb.StepMetrics(
                epoch=batches[-1].epoch if batches else 0,
                step=self.totals["steps"],
                loss=loss or 0.0,
                correct=correct,
                gradient_time_s=gradient_time_s,
                compression_time_s=compression_time_s,
                communication_time_s=self.last_communication_s,
            ),
        )

    def holds(self, request: pb.PushRequest, shards: int | None = None) -> list[pb.PushRequest]:
        """A sharded server: ``request``'s hold to each shard (:func:`holds`; ``shards``: the first that many)."""
        return holds(request, self.shard_versions[:shards])

    def commit(self, request: pb.PushRequest, acks: Sequence[Any]) -> pb.PushRequest:
        """The commit of ``request`` to shard 0 once every shard acknowledged its hold (:func:`commit`)."""
        return commit(request, acks, self.shard_versions[0], self.mode)

    # ------------------------------------------------------------------------- exchanges

    def push(
        self, request: pb.PushRequest, payloads: Sequence[Sequence[Any]], buffers: Sequence[Any], *, streamed=False
    ) -> Exchange[Received | Rejoined]:
        """Push ``request`` with each shard's ``payloads`` (one server: ``[payloads]``) and the model's ``buffers``
        (``streamed``: the parts went ahead on the streamed push open to each shard). Returns the reply to
        :meth:`settle` (a sharded server's: shard 0's commit reply, every shard's slices loaded), or
        :class:`Rejoined` when the push was lost with a session."""
        request.caller.CopyFrom(self.caller)
        if self.placement is None:
            tensors = {"gradients": payloads[0] if payloads else [], "buffers": buffers}
            [reply] = yield [Call(0, PUSH, request, tensors, streamed)]
            if isinstance(reply, CallError):
                return (yield from self._lost(self.membership.failure(reply), request.request_id))
            return reply
        holds = [
            Call(
                k,
                PUSH,
                held,
                {"gradients": payloads[k] if payloads else [], "buffers": buffers if k == 0 else []},
                streamed,
            )
            for k, held in enumerate(self.holds(request))
        ]
        acks = yield holds
        failed = failure_in(acks)
        if failed is not None:
            yield from self._shard_failed(failed, request.request_id)
            return Rejoined((yield from self._pulled_again()))
        commit = self.commit(request, acks)
        if streamed:  # each hold carried the seconds its parts took to encode (its driver's measure): the push's
            commit.metrics.compression_time_s = sum(call.message.metrics.compression_time_s for call in holds)
        return (yield from self._commit(request, commit))

    def _commit(self, request: pb.PushRequest, commit: pb.PushRequest) -> Exchange[Any]:
        """A sharded step once every shard holds the push: the commit to shard 0, then every shard pulled."""
        [reply] = yield [Call(0, PUSH, commit)]
        if isinstance(reply, CallError):
            return (yield from self._lost(self.membership.failure(reply), request.request_id))
        pulled = yield self._shard_pulls(reply.message.certificate, first=0)
        failed = failure_in(pulled) or self._load_shards(pulled, reply.message.version)
        if failed is not None:
            yield from self._shard_failed(failed, request.request_id)
            return Rejoined((yield from self._pulled_again()))
        return reply

    def start(self, address: str) -> Exchange[Received]:
        """The first pull after registering (:meth:`pull_everything`), then the ``run_start`` event (``address``:
        the server's, as the driver names it)."""
        received = yield from self.pull_everything()
        if self.log is not None:
            self.log.event("run_start", address=address, incarnation=self.membership.incarnation, version=self.version)
        return received

    def pull_everything(self) -> Exchange[Received]:
        """The newest parameters and the next work: one server's pull, or a sharded server's shard 0 then every other
        shard's slices (async: the certificate's window), all of one version. Registers again while the server has
        lost this session or a shard is starting again."""
        while True:
            [reply] = yield [Call(0, PULL, pb.PullRequest(caller=self.caller))]
            if isinstance(reply, CallError):
                yield from self.rejoin(self.membership.failure(reply))
                continue
            if self.placement is None:
                self.load(reply)
                return reply
            self.load(reply, parameters=False)
            self.shard_versions[0] = load_shard_reply(self.placement, 0, self._named(), self.buffers, reply)
            pulled = yield self._shard_pulls(reply.message.certificate, first=1)
            failed = failure_in(pulled) or self._load_shards(pulled, reply.message.version, first=1)
            if failed is None:
                return reply
            yield from self._shard_failed(failed)

    def pull_parameters(self) -> Exchange[Received | Rejoined]:
        """One server's parameters alone, the work kept (a streamed reply broke off after its head: the same work is
        computed again from them); :class:`Rejoined` when the pull failed with a session."""
        [reply] = yield [Call(0, PULL, pb.PullRequest(caller=self.caller, parameters_only=True))]
        if isinstance(reply, CallError):
            return (yield from self._lost(self.membership.failure(reply), 0))
        self.load(reply)
        return reply

    def skip(self) -> Exchange[None]:
        """A step with no gradient (the library's, for non-finite gradients): sync, a sample-free push tells the
        version's barrier to go on without this worker (a sharded server's: held on shard 0 only, then committed)."""
        self.totals["steps_skipped"] += 1
        if self.mode != "sync":
            return
        self.request_id += 1
        request = pb.PushRequest(caller=self.caller, base_version=self.version, request_id=self.request_id)
        if self.placement is None:
            [reply] = yield [Call(0, PUSH, request)]
            outcome = reply if isinstance(reply, CallError) else None
            if outcome is None:
                self.load(reply)
        else:
            [ack] = yield [Call(0, PUSH, self.holds(request, shards=1)[0])]
            outcome = (
                ack if isinstance(ack, CallError) else (yield from self._commit(request, self.commit(request, [ack])))
            )
        if isinstance(outcome, CallError):
            yield from self._lost(self.membership.failure(outcome), request.request_id)

    def offer(self) -> Exchange[bool]:
        """Offer the model's layout and values to a server that has none (the library's); whether they became its
        version 0.

        Raises:
            CallError: the server refused (FAILED_PRECONDITION: another worker's model came first and differs).
        """
        request = pb.InitializeRequest(
            caller=self.caller,
            parameter_specs=[pb.TensorSpec(name=n, shape=list(p.shape)) for n, p in zip(self.names, self.params)],
            buffer_specs=[pb.TensorSpec(name=n, shape=list(b.shape)) for n, b in zip(self.buffer_names, self.buffers)],
        )
        while True:
            request.caller.CopyFrom(self.caller)
            tensors = {
                "parameters": [tensor_view(p) for p in self.params],
                "buffers": [tensor_view(b) for b in self.buffers],
            }
            [reply] = yield [Call(0, INITIALIZE, request, tensors)]
            if not isinstance(reply, CallError):
                return reply.accepted
            yield from self.rejoin(self.membership.failure(reply))

    def finish(self, stats: Callable[[], pb.WorkerStats]) -> Exchange[Rejoined | None]:
        """Tell the server this worker is done, with ``stats()`` (kept as :attr:`finished_stats`). After a failure:
        register again, then finish again, or, on planned work, return the pull (:class:`Rejoined`): the restarted
        server may hand out work again."""
        while True:
            reported = stats()
            [reply] = yield [Call(0, FINISH, pb.FinishRequest(caller=self.caller, stats=reported))]
            if not isinstance(reply, CallError):
                self.finished_stats = reported
                return None
            yield from self.rejoin(self.membership.failure(reply))
            if self.planned_work:
                return Rejoined((yield from self._pulled_again()))

    def rejoin(self, failure: Failure, in_flight: int = 0) -> Exchange[bool]:
        """Register again after ``failure``, settling the push ``in_flight`` (its request id; 0: none) by what the
        registration says; returns whether the server had applied that push."""
        if failure == "revoked":
            self.begin_incarnation(self.driver_stats() if self.driver_stats is not None else pb.WorkerStats())
        else:
            logger.warning("worker %s: lost the server's session; registering again", self.membership.worker_id)
        carried = self.carried if failure == "lost" else []  # a revoked incarnation's batches went to the others
        registration = yield from self.membership.register(in_flight, [b.batch_id for b in carried])
        applied = bool(in_flight) and registration.last_request_applied
        if in_flight and self.codec is not None:
            self.codec.settle_lost(applied=applied, redone=failure == "lost" and self.planned_work)
        if applied or failure == "revoked":
            self.carried = []
        if failure == "revoked":
            logger.info(
                "worker %s: rejoined as incarnation %d at version %d",
                self.membership.worker_id,
                self.membership.incarnation,
                registration.version,
            )
        if registration.model_wanted and self.params:  # a server started again before its first checkpoint
            yield from self.offer()
        return applied

    def _lost(self, failure: Failure, in_flight: int) -> Exchange[Rejoined]:
        yield from self.rejoin(failure, in_flight)
        return Rejoined((yield from self._pulled_again()))

    def _pulled_again(self) -> Exchange[Received]:
        """After registering again: pull the newest parameters and the next work, and say so in the events."""
        received = yield from self.pull_everything()
        if self.log is not None:
            self.log.event(
                "rejoined",
                incarnation=self.membership.incarnation,
                version=self.version,
                after=self.membership.last_failure,
            )
        return received

    def _shard_failed(self, error: CallError, in_flight: int = 0) -> Exchange[bool]:
        """A shard failed a call, or the shards answered at different versions: they are starting again together from
        a common version, so register again with shard 0 as after a lost session; whether ``in_flight`` was applied."""
        logger.warning(
            "worker %s: a server shard failed a call (%s); registering again with shard 0",
            self.membership.worker_id,
            error,
        )
        self.membership.last_failure = "lost"
        return (yield from self.rejoin("lost", in_flight))

    def _shard_pulls(self, certificate: bytes, *, first: int) -> list[Call]:
        """Every shard's slices from shard ``first`` on, the followers' after applying ``certificate``'s version."""
        return [
            Call(
                k, PULL, pb.PullRequest(caller=self.caller, certificate=certificate if k else b"", parameters_only=True)
            )
            for k in range(first, self.num_shards)
        ]

    def _load_shards(self, pulled: list[Received], version: int, first: int = 0) -> CallError | None:
        """Load shard ``first``'s and the next shards' pulls; the error to recover from when they do not fit together
        after shard 0 answered at ``version`` (sync: every shard at that version; async: none behind it)."""
        named = self._named()
        for k, reply in enumerate(pulled, start=first):
            self.shard_versions[k] = load_shard_reply(self.placement, k, named, self.buffers, reply)
        versions = self.shard_versions
        self.version = versions[0]
        apart = any(v < version for v in versions) if self.mode == "async" else any(v != version for v in versions)
        return CallError("UNAVAILABLE", f"shard 0 at version {version}, the shards at {versions}") if apart else None

    def _named(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.params))

    # ------------------------------------------------------------------------- replies

    def load(self, received: Received, *, parameters: bool = True) -> int:
        """Take a pull or push reply: its parameters and buffers (``parameters=False``: its version and control only:
        a sharded server's slices come with the pulls, a streamed reply's tensors by themselves), and the adaptive
        controller's Active Fraction from the next push on. Returns its version."""
        self.version = load_reply(self.params, self.buffers, received) if parameters else received.message.version
        codec = self.codec
        updated = controlled_policy(codec.policy, received.message.control) if codec is not None else None
        if codec is not None and updated is not codec.policy:
            if self.log is not None:
                self.log.event(
                    "control_applied",
                    step=self.totals["steps"] + 1,
                    compression_ratio=updated.compressor.ratio,
                    previous_compression_ratio=codec.policy.compressor.ratio,
                    max_staleness=received.message.control.max_staleness,
                )
            codec.policy = updated
        return self.version

    def settle(self, reply: Received, figures: StepFigures) -> bool:
        """The push's verdict (``reply``: its reply, or a sharded server's commit reply): commit or roll back the
        residuals (per shard: where that shard rolled it back), carry a rejected push's batches, count the step and
        load the reply (the tensors it holds: none in a streamed reply's head, whose tensors arrive by themselves, or
        in a commit reply, whose slices came with the pulls). Returns whether it was accepted."""
        message = reply.message
        accepted = message.accepted
        batches, _, loss, correct, samples = self._step
        for shard in range(self.num_shards):  # one verdict, but async a shard's own rollback
            self.codec.settle(shard, accepted=applied_on(message, shard))
        self.carried = [] if accepted else self.carried + batches
        totals = self.totals
        totals["steps"] += 1
        totals["samples"] += samples
        totals["pushes_rejected"] += 0 if accepted else 1
        totals["gradient_time_s"] += figures.gradient_time_s
        totals["compression_time_s"] += figures.compression_time_s
        totals["communication_time_s"] += figures.communication_time_s
        totals["payload_bytes"] += figures.payload_bytes
        totals["dense_bytes"] += self.dense_bytes_per_step
        self.last_communication_s = figures.communication_time_s
        self.load(reply, parameters=self.placement is None and bool(reply.large))  # an Active Fraction: next push on
        if loss is not None:
            epoch = self._epoch
            epoch[0] += loss * samples
            epoch[1] += correct
            epoch[2] += samples
            totals["train_loss"] = epoch[0] / max(epoch[2], 1)
            totals["train_accuracy"] = epoch[1] / max(epoch[2], 1)
        if self.log is not None:
            self._log_step(reply, figures, loss or 0.0, correct, samples)
        return accepted

    def _log_step(self, reply: Received, figures: StepFigures, loss: float, correct: int, samples: int) -> None:
        totals, message = self.totals, reply.message
        self.log.event(
            "push",
            step=totals["steps"],
            num_samples=samples,
            batch_ids=self._step[1],
            payload_bytes=figures.payload_bytes,
            push_bytes=figures.push_bytes,
            reply_bytes=figures.reply_bytes,
            accepted=message.accepted,
            staleness=message.staleness,
            version=self.version,
            **({"rolled_back": list(message.rolled_back)} if message.rolled_back else {}),  # async: per shard
        )
        if totals["steps"] % LOG_EVERY_STEPS and not message.work.finished:
            return
        step_s = figures.gradient_time_s + figures.compression_time_s + figures.communication_time_s
        self.log.scalars(
            "train",
            totals["steps"],
            {
                "loss": loss,
                "accuracy": correct / samples if samples else 0.0,
                "throughput": samples / step_s if step_s > 0 else 0.0,
                "gradient_time_s": figures.gradient_time_s,
                "compression_time_s": figures.compression_time_s,
                "communication_time_s": figures.communication_time_s,
                "samples_processed": totals["samples"],
                "bytes_sent": figures.bytes_sent,
                "bytes_received": figures.bytes_received,
                "compression_ratio": totals["dense_bytes"] / max(totals["payload_bytes"], 1),
                "staleness": message.staleness,
            },
        )

    # ------------------------------------------------------------------------- totals

    def begin_incarnation(self, reported: pb.WorkerStats) -> None:
        """A new incarnation of this process registered: its stats count from here (``reported``: what
        :meth:`stats` says now, which stays with the earlier incarnations in the run summary)."""
        # One new dict, assigned at once: the heartbeat thread reads it meanwhile.
        self._earlier = {
            field.name: self._earlier.get(field.name, 0) + getattr(reported, field.name)
            for field in pb.WorkerStats.DESCRIPTOR.fields
            if field.name not in PER_PROCESS_STATS
        }

    def stats(
        self, *, bytes_sent: int, bytes_received: int, total_time_s: float, emulated_delay_s: float = 0.0
    ) -> pb.WorkerStats:
        """The running totals of this incarnation, as the heartbeat and Finish report them (the arguments count for
        the process: what earlier incarnations reported is taken off)."""
        totals = self.totals
        stats = pb.WorkerStats(
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            total_time_s=total_time_s,
            emulated_delay_s=emulated_delay_s,
            **{name: totals[name] for name in COUNTS + SECONDS if name != "steps_skipped"},
        )
        for name, earlier in self._earlier.items():
            setattr(stats, name, getattr(stats, name) - type(getattr(stats, name))(earlier))
        return stats


__all__ = ["Rejoined", "StepFigures", "StepMachine", "applied_on", "commit", "holds"]
