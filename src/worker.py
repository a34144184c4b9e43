"""A parameter-server worker: register -> pull -> (train on the handed batches -> push) until finished.

The worker learns the run from the server at registration (the config's training and compression
settings and the model layout), so a worker on another host needs only the server address and the
auth token; its own config keeps only what is local to its machine (:data:`LOCAL_FIELDS`).

Per step: the server hands the worker batches (sample indices) with the parameters to train on;
the worker computes the gradient (with ``system.local_steps`` = H > 1 it takes H local SGD steps,
one per batch, and pushes the sum of their gradients), puts each parameter's gradient through
error feedback (``compensate``) and the compression policy, and pushes. The push's reply carries
the verdict, the next parameters and the next batches: one RPC per step. A push turned away by the
staleness policy rolls the residuals back (no gradient mass is lost) and its batches are carried
into the next push, which lists them too.

Staying alive: a background thread sends a heartbeat every ``system.heartbeat_interval`` with the
worker's running totals. If the server loses this worker's session (it restarted from a checkpoint),
the worker registers again (the client's ``wait_for_ready`` waits out the restart), learns whether its
last push was applied (commit, or discard: its samples will be redone) and goes on. If the server
declared this incarnation failed while the process lived (a partition, a long pause, a hang that
ended: it was silent for longer than ``system.heartbeat_timeout``), the worker rejoins: it settles
what it held (a push the server did not apply is rolled back into the residual; the batches it
carried were handed to others and are not its own any more), registers as a new incarnation and
goes on, up to ``system.max_rejoins`` times; then it stops with :class:`IncarnationRevoked`. The
decision is :func:`src.ps.worker_protocol.failed_call`'s and the settling :meth:`WorkerStep.rejoined`'s,
which the virtual-time worker runs too.

Emulation (:mod:`src.emulation.netem`, the run config's ``emulation`` section, learnt from the server): a
slowed worker waits after each forward/backward (counted as gradient time), and a narrow uplink
makes every message wait its transfer time in the client before it is sent (counted as
communication time); ``emulated_delay_s`` in the totals is the sum of both waits.

Measured per worker: gradient time (forward/backward), compression time, communication time (the
push round trip, including waiting at the sync barrier; the worker computes nothing meanwhile, so
all of it is exposed communication, :mod:`src.telemetry.exposed_comm`), bytes sent and received (the serialized
messages or frames of ``system.transport``, :func:`~src.transport.clients.make_client`), samples, loss and accuracy.
Events and TensorBoard scalars go to ``<log_dir>/worker_<k>``; the totals go to the server with each
heartbeat and at Finish, which puts them in the run summary.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import grpc

from src import parameter_server_pb2 as pb
from src.common.faults import FaultInjector
from src.config import Config, SetupError, validate_config
from src.emulation.netem import ComputeDelay, conditions_for, link_or_none, worker_seed
from src.metrics import MetricsLogger
from src.ps.sharding import Sharding
from src.ps.worker_protocol import Failure, Heartbeats, IncarnationRevoked, Rejoins, check_session_lost  # noqa: F401  (IncarnationRevoked: part of this module's interface)
from src.ps.worker_step import WorkerStep, check_layout
from src.ps.worker_stream import ShardStreams, StreamedModel
from src.ps.workers import SERVER_PATHS
from src.telemetry import tracing
from src.trainer import load_split, model_from_config, resolve_device
from src.transport.clients import make_client
from src.transport.grpc import ParameterServerClient, Received, require_auth_token
from src.transport.stream import PushStream, ReplyBroken
from src.transport.wire import Outgoing, chunk_size

logger = logging.getLogger(__name__)

LOCAL_FIELDS = (
    *SERVER_PATHS,  # its own files and folders (the server does not send its own)
    "training.device",
    "system.server_address",
    "system.shard_addresses",
    "system.transport",
    "system.inject_faults",
    "system.max_rejoins",
)
"""Fields a worker takes from its own config; everything else comes from the server."""


class _ShardsApart(grpc.RpcError):
    """The shards answered a pull at different versions (some of them are starting again): pull again."""

    def __init__(self, version: int, versions: list[int]):
        super().__init__(f"shard 0 at version {version}, the others at {versions}")
        self._message = str(self)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._message


class ServerEndedRun(RuntimeError):
    """The server stopped before this worker was told the run is finished."""


def merge_run_config(local: Config, run_config_json: str) -> Config:
    """The server's run config with this worker's :data:`LOCAL_FIELDS` put back."""
    merged = json.loads(run_config_json)
    mine = local.to_dict()
    for dotted in LOCAL_FIELDS:
        section, field = dotted.split(".")
        merged[section][field] = mine[section][field]
    return validate_config(merged)


class Worker:
    """One worker of a parameter-server run; :meth:`run` trains until the server says the run is finished.

    A real process's driver of :class:`~src.ps.worker_step.WorkerStep`: calls over ``system.transport``,
    wall-clock timings, emulated waits, heartbeats, re-registration.

    Args:
        config: this worker's config (its :data:`LOCAL_FIELDS` are used; the rest comes from the server).
        worker_id: ``0..num_workers-1``; it is also the shard the worker reads first.
        address: the server's ``host:port`` (default ``system.server_address``).
        token: the run's auth token (default :func:`~src.transport.grpc.require_auth_token`).
        tensorboard: also write TensorBoard scalars next to ``events.jsonl``.
        connect_timeout_s: how long to wait for the server at (re-)registration.
        faults: fire this worker's ``system.inject_faults`` (``False`` for a restarted worker).
    """

    def __init__(
        self,
        config: Config,
        worker_id: int,
        *,
        address: str | None = None,
        token: str | None = None,
        tensorboard: bool = True,
        connect_timeout_s: float = 300.0,
        faults: bool = True,
    ):
        self.local_config = config
        self.worker_id = worker_id
        self.address = address or config.system.server_address
        self.token = token or require_auth_token(config.system)
        self.tensorboard = tensorboard
        self.connect_timeout_s = connect_timeout_s
        self.faults = FaultInjector(config.system.inject_faults, "worker", worker_id, enabled=faults)
        self.client: ParameterServerClient | None = None
        self.shard_clients: list[ParameterServerClient] = []  # a sharded server: shards 1.. (shard 0 is client)
        self._shard_calls: ThreadPoolExecutor | None = None  # one thread per shard: its calls go out at once
        self.caller = pb.Caller(worker_id=worker_id)
        self.incarnation = 0
        self.rejoins = Rejoins(worker_id, config.system.max_rejoins)
        self.last_failure: Failure | None = None  # what the last re-registration followed
        self.step: WorkerStep | None = None
        self._started = time.perf_counter()
        self.compute_delay: ComputeDelay | None = None  # emulation, set once the run config is known
        self.streamed: StreamedModel | None = None  # system.streaming: the hooks on the model
        self._stream_calls: ThreadPoolExecutor | None = None  # system.streaming: the thread that moves the pushes
        self._generation = 0  # system.streaming: streamed replies so far (src/ps/worker_stream.py)
        self._last_calls: list[Future] = []  # system.streaming: the newest push's calls (a reply may be arriving)
        self._pieced_parts = True  # system.streaming: large parts in pieces (PushStream.pieced)

    def emulated_delay_s(self) -> float:
        """Seconds this process waited for emulated compute and uplink (:mod:`src.emulation.netem`)."""
        uplinks = [c.uplink for c in self._clients() if c.uplink is not None]
        return (self.compute_delay.delay_s if self.compute_delay else 0.0) + sum(u.delay_s for u in uplinks)

    def _clients(self) -> list[ParameterServerClient]:
        """Every connection: the server's (shard 0's), then the other shards'."""
        return ([self.client] if self.client is not None else []) + self.shard_clients

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self._clients())

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self._clients())

    def stats(self) -> pb.WorkerStats:
        """This process's running totals (read by the heartbeat thread too)."""
        step = self.step
        if step is None:
            return pb.WorkerStats(total_time_s=time.perf_counter() - self._started)
        return step.stats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            total_time_s=time.perf_counter() - self._started,
            emulated_delay_s=self.emulated_delay_s(),
        )

    def run(self) -> dict[str, Any]:
        """Register, train on whatever the server hands out until it says finished, finish; returns the totals.

        Raises:
            grpc.RpcError: the server refused a call (bad auth, bad push) or went away for good.
            IncarnationRevoked: the server declared this incarnation failed, and the rejoin budget is spent.
            ValueError: the local model does not match the server's layout.
        """
        self.client = make_client(
            self.address,
            transport=self.local_config.system.transport,
            token=self.token,
            system=self.local_config.system,
            connect_timeout_s=self.connect_timeout_s,
        )
        heartbeats = None
        try:
            registration = self._register(0)
            config = merge_run_config(self.local_config, registration.run_config_json)
            self._connect_shards(config)
            conditions = conditions_for(config.emulation, self.worker_id)
            for client in self._clients():
                client.uplink = link_or_none(conditions.uplink)
            self.compute_delay = ComputeDelay(conditions, worker_seed(config.training.seed, self.worker_id))
            interval = config.system.heartbeat_interval
            heartbeats = Heartbeats(
                lambda: self.client.heartbeat(self.caller, self.stats(), timeout=interval * 2),
                interval,
                name=f"worker-{self.worker_id}-heartbeat",
            )
            heartbeats.start()
            return self._train(config, registration)
        finally:
            for client in self.shard_clients:
                client.close()
            if self._shard_calls is not None:
                self._shard_calls.shutdown()
            if self._stream_calls is not None:
                self._stream_calls.shutdown()  # the last reply's tensors, still arriving, are in (or failed)
            if self.streamed is not None:
                self.streamed.close()
            if heartbeats is not None:
                heartbeats.stop_and_close(self.client.close)
            else:
                self.client.close()

    def _connect_shards(self, config: Config) -> None:
        """A sharded server (``system.num_servers`` > 1, as the server says): a connection to every other shard
        at this worker's ``system.shard_addresses`` (shard 0 first: the server this worker registered with)."""
        shards, addresses = config.system.num_servers, list(self.local_config.system.shard_addresses)
        if shards == 1:
            return
        if len(addresses) != shards:
            raise SetupError(
                f"system.shard_addresses: the server runs {shards} shards; give every shard's host:port, shard 0 "
                f"first (got {len(addresses)})"
            )
        self.shard_clients = [
            make_client(
                address,
                transport=self.local_config.system.transport,
                token=self.token,
                system=self.local_config.system,
                connect_timeout_s=self.connect_timeout_s,
            )
            for address in addresses[1:]
        ]
        self._shard_calls = ThreadPoolExecutor(max_workers=shards, thread_name_prefix=f"worker-{self.worker_id}-shard")

    def _register(self, last_request_id: int, carried: list[pb.Batch] = ()) -> pb.RegisterReply:
        registration = self.client.register(self.worker_id, last_request_id, [b.batch_id for b in carried])
        self.caller = pb.Caller(worker_id=self.worker_id, session=registration.session)
        self.incarnation = registration.incarnation
        return registration

    def _train(self, config: Config, registration: pb.RegisterReply) -> dict[str, Any]:
        t, system = config.training, config.system
        device = resolve_device(t.device)
        model = model_from_config(config).to(device)
        placement = Sharding.of_run(model, system, self.token).placement if self.shard_clients else None
        check_layout(self.worker_id, config, model, registration, placement)
        train_set = load_split(config, "train")
        with MetricsLogger(
            Path(system.log_dir) / f"worker_{self.worker_id}",
            tensorboard=self.tensorboard and "tensorboard" in config.metrics.trackers,
            role="worker",
            worker=self.worker_id,
        ) as log:
            step = self.step = WorkerStep(
                config,
                self.worker_id,
                model=model,
                train_set=train_set,
                device=device,
                log=log,
                faults=self.faults,
                placement=placement,
            )
            if system.streaming:
                self.streamed = StreamedModel(model, step.params, step.buffers)
                self._pieced_parts = system.pipelined_replies  # sent only when the server pipelines
                self._stream_calls = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"worker-{self.worker_id}-push"
                )
            received = self._pull_everything(step)
            log.event("run_start", address=self.address, incarnation=self.incarnation, version=step.version)
            logger.info(
                "worker %d: registered with %s as incarnation %d at version %d (%s)",
                self.worker_id,
                self.address,
                self.incarnation,
                step.version,
                system.aggregation_mode,
            )
            model.train()
            while True:
                if received.message.work.finished:
                    self._reply_in()
                    stats = self.stats()
                    if self._finish(stats):
                        break
                    received = self._pull_again(step, log)  # the server restarted, or failed us, before we finished
                    continue
                train_step = self._train_step_streamed if self.streamed is not None else self._train_step
                reply = train_step(step, received)
                # None: lost with the server's session or our incarnation: registered again
                received = reply if reply is not None else self._pull_again(step, log)

            result = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
            step.write_ledger(system.log_dir)
            log.event("run_end", incarnation=self.incarnation, **result)
        logger.info(
            "worker %d: finished at version %d: %d samples in %d steps",
            self.worker_id,
            step.version,
            step.totals["samples"],
            step.totals["steps"],
        )
        return {"worker_id": self.worker_id, "incarnation": self.incarnation, **result}

    def _train_step(self, step: WorkerStep, received: Received) -> Received | None:
        """Compute the handed batches' gradient, push it and settle the reply; returns the reply, or ``None`` when
        the push was lost with the server's session or this incarnation (registered again: pull before going on)."""
        batches = list(received.message.work.batches)
        step_started = time.perf_counter()
        with tracing.span("forward_backward", step=step.totals["steps"] + 1, batches=len(batches)):
            loss, correct, samples = step.compute(batches)
            if batches:
                self.compute_delay.after_step(time.perf_counter() - step_started)  # emulated straggler
        computed = time.perf_counter()
        step.reach_step()
        with tracing.span("compress"):
            if self.shard_clients:
                per_shard = step.encode_shards(batches)
                payloads = [payload for shard in per_shard for payload in shard]
            else:
                payloads = step.encode(batches)  # no batches: a flush of what error feedback carries
        compressed = time.perf_counter()
        request = step.request(
            self.caller,
            batches,
            loss,
            correct,
            gradient_time_s=computed - step_started,
            compression_time_s=compressed - computed,
        )
        sent_before, received_before = self.bytes_sent, self.bytes_received
        with tracing.span("push", request_id=request.request_id):  # blocked on the reply: exposed communication
            if self.shard_clients:
                reply = self._push_to_shards(step, request, per_shard, step.buffers_to_send(batches))
            else:
                reply = self._push(request, payloads, step.buffers_to_send(batches))
        if not isinstance(reply, Received):
            return None
        step.settle(
            reply,
            batches,
            request,
            payload_bytes=sum(chunk_size(p) for p in payloads),
            loss=loss,
            correct=correct,
            samples=samples,
            gradient_time_s=computed - step_started,
            compression_time_s=compressed - computed,
            communication_time_s=time.perf_counter() - compressed,
            push_bytes=self.bytes_sent - sent_before,
            reply_bytes=self.bytes_received - received_before,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )
        tracing.record("step", step_started, time.perf_counter(), step=step.totals["steps"])
        return reply

    def _train_step_streamed(self, step: WorkerStep, received: Received) -> Received | None:
        """:meth:`_train_step` communicating while it computes (``system.streaming``, :mod:`src.ps.worker_stream`).

        The forward takes each layer's parameters as the previous reply brings them; backward hands each gradient
        to the push as it is ready, and the push's thread compresses and sends it meanwhile; after backward the
        push's own message follows, and the step ends with the reply's head (verdict, version, next work), whose
        tensors go on arriving during the next forward. A sharded server: each shard's slices stream to it as its
        hold, then the commit and the pulls go as unstreamed (:meth:`_commit_to_shards`). Returns that head (a
        reply without tensors), ``received`` again when the previous reply broke off after its head (the parameters
        pulled: the same work computed again), or ``None`` when the push was lost with the server's session or
        this incarnation.
        """
        streamed, sharded = self.streamed, bool(self.shard_clients)
        batches = list(received.message.work.batches)
        self._generation += 1
        generation = self._generation

        def encode(shard: int, index: int) -> Any:  # on a push's thread, while backward goes on
            with tracing.span("compress", shard=shard, part=index):
                return step.encode_slice(shard, index, batches) if sharded else step.encode_part(index, batches)

        def ended(stream: PushStream, done: Future) -> None:  # on the push's thread: the reply is in, or it failed
            if stream.first_sent is not None:  # the push in flight, hidden or not (reply_wait: what was not)
                tracing.record("push", stream.first_sent, time.perf_counter(), step=step.totals["steps"] + 1)
            if done.exception() is not None:
                streamed.reply_broken(generation, done.exception())

        clients = self._clients()
        streams = [
            PushStream(lambda index, k=k: encode(k, index), streamed.on_large(generation)) for k in range(len(clients))
        ]
        for stream in streams:  # parts in pieces only for a server that reads them as they come
            stream.pieced = self._pieced_parts
        calls = [
            (self._shard_calls or self._stream_calls).submit(client.push_streamed, stream)
            for client, stream in zip(clients, streams)
        ]
        for stream, call in zip(streams, calls):
            call.add_done_callback(lambda done, stream=stream: ended(stream, done))
        self._last_calls = calls
        waited_before = streamed.waited_s
        step_started = time.perf_counter()
        streamed.begin_push(ShardStreams(streams, step.sharded.slices_of(step.names)) if sharded else streams[0])
        try:
            with tracing.span("forward_backward", step=step.totals["steps"] + 1, batches=len(batches)):
                loss, correct, samples = step.compute(batches)
                if batches:
                    self.compute_delay.after_step(time.perf_counter() - step_started)  # emulated straggler
        except ReplyBroken as broken:  # the previous reply's tensors stopped coming: pull them, compute again
            self._abort(streams, broken)
            logger.warning("worker %d: %s; pulling the parameters", self.worker_id, broken)
            try:
                step.load(self.client.pull(self.caller, parameters_only=True))
            except grpc.RpcError as exc:
                self._rejoin(self._failure(exc), in_flight=0)
                return None
            streamed.loaded()
            return received
        except BaseException as exc:
            self._abort(streams, exc)
            raise
        streamed.end_backward()
        computed = time.perf_counter()
        forward_waits = streamed.waited_s - waited_before  # exposed: the forward waited for parameters
        gradient_time_s = computed - step_started - forward_waits
        step.reach_step()
        request = step.request(
            self.caller, batches, loss, correct, gradient_time_s=gradient_time_s, compression_time_s=0.0
        )
        messages = step.holds(request) if sharded else [request]
        buffers = step.buffers_to_send(batches)

        for k, (stream, message) in enumerate(zip(streams, messages)):

            def compression_time(stream=stream, message=message) -> None:  # every part encoded: their seconds
                message.metrics.compression_time_s = stream.encode_s

            stream.close(Outgoing(message, {"buffers": buffers if k == 0 else []}), before_send=compression_time)
        try:
            with tracing.span("reply_wait", request_id=request.request_id):  # exposed: nothing left to compute
                heads = [stream.wait_head() for stream in streams]
                sent_before, received_before = self.bytes_sent, self.bytes_received
                reply = self._commit_to_shards(step, request, heads) if sharded else Received(heads[0], {})
        except grpc.RpcError as exc:
            if sharded:
                self._shard_failed(exc, in_flight=request.request_id)
            else:
                self._rejoin(self._failure(exc), in_flight=request.request_id)  # settles it as registration says
            return None
        if not isinstance(reply, Received):
            return None
        head_in = time.perf_counter()
        if sharded:  # the pulls brought every slice
            streamed.loaded()
            push_bytes = sum(s.sent_bytes for s in streams) + self.bytes_sent - sent_before
            reply_bytes = sum(s.reply_bytes for s in streams) + self.bytes_received - received_before
        else:
            streamed.expect(generation)
            push_bytes, reply_bytes = streams[0].sent_bytes, streams[0].reply_bytes
        step.settle(
            reply,
            batches,
            request,
            payload_bytes=sum(chunk_size(payload) for stream in streams for _, payload in stream.encoded),
            loss=loss,
            correct=correct,
            samples=samples,
            gradient_time_s=gradient_time_s,
            compression_time_s=sum(stream.encode_s for stream in streams),
            communication_time_s=head_in - computed + forward_waits,
            push_bytes=push_bytes,
            reply_bytes=reply_bytes,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            parameters=False,
        )
        tracing.record("step", step_started, head_in, step=step.totals["steps"])
        return reply

    def _abort(self, streams: list[PushStream], error: BaseException) -> None:
        """The step is given up before its push went out: the push's threads stop waiting for its parts."""
        self.streamed.end_backward()
        for stream in streams:
            stream.abort(error)

    def _reply_in(self) -> None:
        """``system.streaming``: wait until the last reply's tensors are in (or it broke off), so the totals count
        every byte it brought."""
        wait(self._last_calls)

    def _finish(self, stats: pb.WorkerStats) -> bool:
        """Tell the server this worker is done; ``False``: the call failed and the worker registered again."""
        try:
            self.client.finish(self.caller, stats)
            return True
        except grpc.RpcError as exc:
            self._rejoin(self._failure(exc), in_flight=0)
            return False

    def _pull_again(self, step: WorkerStep, log: MetricsLogger) -> Received:
        """After registering again: pull the newest parameters and the next work, and say so in the events."""
        received = self._pull_everything(step)
        log.event("rejoined", incarnation=self.incarnation, version=step.version, after=self.last_failure)
        return received

    def _push(self, request: pb.PushRequest, payloads: list[bytes], buffers: list) -> Received | bool:
        """Push; on a lost session or a revoked incarnation register again. Returns the reply, or (the reply
        lost) whether the push was applied.

        Raises:
            IncarnationRevoked: the server declared this incarnation failed, and the rejoin budget is spent.
        """
        try:
            return self.client.push(request, payloads, buffers)
        except grpc.RpcError as exc:
            failure = self._failure(exc)
        # Join again and ask whether the push made it into an update (before the server's checkpoint,
        # or before it failed this incarnation).
        return self._rejoin(failure, in_flight=request.request_id)

    def _push_to_shards(
        self, step: WorkerStep, request: pb.PushRequest, per_shard: list[list[bytes]], buffers: list
    ) -> Received | bool:
        """A sharded server's step (sync: :mod:`src.ps.shard_rounds`; async: :mod:`src.ps.shard_async`): hold the
        slices on every shard at once, commit to shard 0 (its reply: the verdict, the next work, the certificate),
        then pull every shard's slices at once, the followers' with the certificate. Returns the commit's reply, or
        (lost) whether it was applied. A shard that refuses a call or goes away: register again (:meth:`_shard_failed`).
        """
        calls = [
            self._shard_calls.submit(client.push, held, per_shard[k], buffers if k == 0 else [])
            for k, (client, held) in enumerate(zip(self._clients(), step.holds(request)))
        ]
        try:
            acks = [call.result().message for call in calls]
        except grpc.RpcError as exc:
            return self._shard_failed(exc, in_flight=request.request_id)
        return self._commit_to_shards(step, request, acks)

    def _commit_to_shards(self, step: WorkerStep, request: pb.PushRequest, acks: list[pb.PushReply]) -> Received | bool:
        """The rest of a sharded step once every shard holds its slices (``acks``: their replies): commit to shard 0,
        then pull every shard's slices. Returns the commit's reply, or (lost) whether it was applied."""
        reply = self._push(step.commit(request, acks), [], [])
        if isinstance(reply, Received):
            try:
                versions = self._pull_shards(step, reply.message.certificate)
                if step.shards_apart(reply.message.version):
                    raise _ShardsApart(reply.message.version, versions)
            except grpc.RpcError as exc:
                return self._shard_failed(exc, in_flight=request.request_id)
        return reply

    def _shard_failed(self, exc: grpc.RpcError, *, in_flight: int) -> bool:
        """A shard refused a call or went away: the shards are starting again together from a common version
        (src/launch/ps.py), so register again with shard 0 as after a server restart; whether the push
        ``in_flight`` (its request id; 0: none) was applied, as :meth:`_rejoin` says."""
        logger.warning(
            "worker %d: a server shard failed a call (%s: %s); registering again with shard 0",
            self.worker_id,
            exc.code().name,
            exc.details(),
        )
        return self._rejoin("lost", in_flight=in_flight)

    def _pull_everything(self, step: WorkerStep) -> Received:
        """Pull the parameters and work (every shard's slices, all of one version, from a sharded server),
        registering again while a server has lost this session or a shard fails."""
        while True:
            received = self._pull()
            if not self.shard_clients:
                step.load(received)
                if self.streamed is not None:
                    self.streamed.loaded()
                return received
            if self.streamed is not None:
                self.streamed.loaded()
            step.load(received, parameters=False)
            step.load_shard(0, received)
            try:
                versions = self._pull_shards(step, received.message.certificate, first=1)  # async: the window
            except grpc.RpcError as exc:
                self._shard_failed(exc, in_flight=0)
                continue
            if not step.shards_apart(received.message.version):
                return received
            self._shard_failed(_ShardsApart(received.message.version, versions), in_flight=0)

    def _pull_shards(self, step: WorkerStep, certificate: bytes, *, first: int = 0) -> list[int]:
        """Every shard's slices from shard ``first`` on, at once (the followers' after applying ``certificate``'s
        version), into ``step``; their versions."""
        clients = self._clients()
        pulls = {
            k: self._shard_calls.submit(
                clients[k].pull, self.caller, certificate=certificate if k else b"", parameters_only=True
            )
            for k in range(first, len(clients))
        }
        return [step.load_shard(k, pull.result()) for k, pull in pulls.items()]

    def _failure(self, exc: grpc.RpcError) -> Failure:
        """What ``exc`` means (:func:`src.ps.worker_protocol.check_session_lost`); spends a rejoin when revoked."""
        return check_session_lost(exc, self.worker_id, self.rejoins)

    def _rejoin(self, failure: Failure, *, in_flight: int) -> bool:
        """Register again after ``failure``, settling the push ``in_flight`` (its request id; 0: none);
        returns whether the server had applied that push."""
        step = self.step
        self.last_failure = failure
        if failure == "revoked":
            step.begin_incarnation(self.stats())
        else:
            logger.warning("worker %d: lost the server's session; registering again", self.worker_id)
        registration = self._register(in_flight, step.carried_to_register(failure))
        applied = bool(in_flight) and registration.last_request_applied
        step.rejoined(failure, in_flight=bool(in_flight), applied=applied)
        if failure == "revoked":
            logger.info(
                "worker %d: rejoined as incarnation %d at version %d",
                self.worker_id,
                self.incarnation,
                registration.version,
            )
        return applied

    def _pull(self) -> Received:
        """Pull the parameters and work, registering again while the server has lost this session (or revoked it)."""
        while True:
            try:
                with tracing.span("pull"):
                    return self.client.pull(self.caller)
            except grpc.RpcError as exc:
                self._rejoin(self._failure(exc), in_flight=0)
