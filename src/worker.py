"""A parameter-server worker process: register -> pull -> (train on the handed batches -> push) until finished.

The worker learns the run from the server at registration (training and compression settings, the model layout), so
a worker on another host needs only the server address and the auth token; its own config keeps only what is local
to its machine (:data:`~src.ps.worker.run_config.LOCAL_FIELDS`).

Per step the server hands out batches (sample indices) with the parameters; the worker computes their gradient
(:class:`~src.ps.worker.compute.WorkerCompute`) and pushes it, and the reply carries the verdict, the next parameters
and the next batches (a sharded server's step: a hold on every shard, a commit, a pull from every shard). What is sent,
and what a reply or a failed call means, is the step machine's (:class:`~src.ps.worker.machine.StepMachine`: the
protocol, compression and error feedback, registering again after a lost session or a revoked incarnation, up to
``system.max_rejoins`` times, then :class:`~src.ps.worker.membership.IncarnationRevoked`). This module drives it in a
process: the calls on ``system.transport``'s connections (:class:`~src.ps.worker.connections.Connections`, and a
heartbeat thread with the running totals every ``system.heartbeat_interval``), the wall clock, emulated stragglers and
links. With ``system.streaming`` the push travels while backward computes, and the next forward takes each layer's
parameters as the reply brings them (:mod:`src.ps.worker.streaming`).

Emulation (:mod:`src.emulation.netem`, the run config's ``emulation``): a slowed worker waits after each
forward/backward (counted as gradient time), and a narrow uplink makes every message wait its transfer time before it
is sent (counted as communication time); ``emulated_delay_s`` in the totals is the sum of both waits.

Measured per worker: gradient, compression and communication time (the push round trip, the sync barrier's wait
included: the worker computes nothing meanwhile, so all of it is exposed communication,
:mod:`src.telemetry.exposed_comm`), bytes sent and received (the messages or frames of ``system.transport``), samples,
loss and accuracy. Events and TensorBoard scalars go to ``<log_dir>/worker_<k>``; the totals go to the server with
each heartbeat and at Finish, which puts them in the run summary.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from src import parameter_server_pb2 as pb
from src.common.faults import FaultInjector
from src.config import Config
from src.emulation.netem import ComputeDelay, conditions_for, link_or_none, worker_seed
from src.ps.shards.shard_zero import Sharding
from src.ps.worker import (
    Connections,
    IncarnationRevoked,
    Membership,
    Rejoined,
    Rejoins,
    StepMachine,
    StreamedModel,
    WorkerCompute,
    check_layout,
    worker_log,
)
from src.ps.worker.run_config import check_shard_addresses, merge_run_config
from src.telemetry import tracing
from src.trainer import load_split, model_from_config, resolve_device
from src.transport.clients import make_client
from src.transport.settings import require_auth_token
from src.transport.stream import ReplyBroken
from src.transport.wire import Received

logger = logging.getLogger(__name__)


class Worker:
    """One worker of a parameter-server run; :meth:`run` trains until the server says the run is finished.

    Args:
        config: this worker's config (its local fields are used, :data:`~src.ps.worker.run_config.LOCAL_FIELDS`; the
            rest comes from the server).
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
        self.membership = Membership(worker_id, Rejoins(worker_id, config.system.max_rejoins))
        self.connections: Connections | None = None
        self.machine: StepMachine | None = None
        self.compute: WorkerCompute | None = None
        self.streamed: StreamedModel | None = None  # system.streaming: the hooks on the model
        self._generation = 0  # system.streaming: streamed replies so far (src/ps/worker/streaming.py)
        self.pipelined = False  # system.streaming: the server steps slices as they arrive (pipelined replies)
        self._started = time.perf_counter()
        self.compute_delay: ComputeDelay | None = None  # emulation, set once the run config is known

    def _client(self, address: str):
        system = self.local_config.system
        return make_client(
            address,
            transport=system.transport,
            token=self.token,
            system=system,
            connect_timeout_s=self.connect_timeout_s,
        )

    def emulated_delay_s(self) -> float:
        """Seconds this process waited for emulated compute and uplink (:mod:`src.emulation.netem`)."""
        uplinks = [c.uplink for c in self.connections.clients if c.uplink is not None] if self.connections else []
        return (self.compute_delay.delay_s if self.compute_delay else 0.0) + sum(u.delay_s for u in uplinks)

    def stats(self) -> pb.WorkerStats:
        """This process's running totals (read by the heartbeat thread too)."""
        total_time_s = time.perf_counter() - self._started
        return self.connections.stats(self.machine, total_time_s, self.emulated_delay_s())

    def run(self) -> dict[str, Any]:
        """Register, train on whatever the server hands out until it says finished, finish; returns the totals.

        Raises:
            CallError: the server refused a call (bad auth, bad push) or went away for good.
            IncarnationRevoked: the server declared this incarnation failed, and the rejoin budget is spent.
            SetupError: the local model does not match the server's layout.
        """
        connections = self.connections = Connections([self._client(self.address)], name=f"worker-{self.worker_id}")
        try:
            registration = connections.run(self.membership.register())
            config = merge_run_config(self.local_config, registration.run_config_json)
            shards, addresses = config.system.num_servers, list(self.local_config.system.shard_addresses)
            if shards > 1:
                check_shard_addresses(shards, len(addresses), "list in system.shard_addresses")
                clients = [connections.clients[0], *(self._client(address) for address in addresses[1:])]
                connections = self.connections = Connections(clients, name=f"worker-{self.worker_id}")
            conditions = conditions_for(config.emulation, self.worker_id)
            for client in connections.clients:
                client.uplink = link_or_none(conditions.uplink)
            self.compute_delay = ComputeDelay(conditions, worker_seed(config.training.seed, self.worker_id))
            name = f"worker-{self.worker_id}-heartbeat"
            connections.start_heartbeats(self.membership, self.stats, config.system.heartbeat_interval, name)
            return self._train(config, registration)
        finally:
            connections.close()
            if self.streamed is not None:
                self.streamed.close()

    def _train(self, config: Config, registration: pb.RegisterReply) -> dict[str, Any]:
        t, system = config.training, config.system
        device = resolve_device(t.device)
        model = model_from_config(config).to(device)
        sharded = len(self.connections.clients) > 1
        placement = Sharding.of_run(model, system, self.token).placement if sharded else None
        check_layout(self.worker_id, config, model, registration, placement)
        with worker_log(config, self.worker_id, tensorboard=self.tensorboard) as log:
            compute = self.compute = WorkerCompute(
                config, self.worker_id, model=model, train_set=load_split(config, "train"), device=device, log=log,
                faults=self.faults,
            )  # fmt: skip
            machine = self.machine = compute.step_machine(
                self.membership, system, placement=placement, stats=self.stats
            )
            if system.streaming:
                self.streamed = StreamedModel(model, compute.params, compute.buffers)
                self.pipelined = system.pipelined_replies
            received = self._pulled(self.connections.run(machine.start(self.address)))
            logger.info(
                "worker %d: registered with %s as incarnation %d at version %d (%s)",
                self.worker_id,
                self.address,
                self.membership.incarnation,
                machine.version,
                system.aggregation_mode,
            )
            model.train()
            while True:
                if received.message.work.finished:
                    self.connections.wait_streams()  # the last reply's tensors are in: the totals count them
                    rejoined = self.connections.run(machine.finish(self.stats))
                    if rejoined is None:
                        break
                    received = self._pulled(rejoined.work)  # the server restarted, or failed us, before we finished
                    continue
                step = self._step_streamed if self.streamed is not None else self._step
                received = step(received)
            result = compute.end_run(machine, system.log_dir)
        logger.info(
            "worker %d: finished at version %d: %d samples in %d steps",
            self.worker_id,
            machine.version,
            machine.totals["samples"],
            machine.totals["steps"],
        )
        return {"worker_id": self.worker_id, "incarnation": self.membership.incarnation, **result}

    def _pulled(self, received: Received) -> Received:
        """The machine pulled every tensor: a streamed worker's forward waits for none."""
        if self.streamed is not None:
            self.streamed.loaded()
        return received

    def _compute(self, batches: list[pb.Batch], started: float) -> tuple[float, int, int]:
        """The handed batches' gradient, then an emulated straggler's wait (counted as compute)."""
        machine = self.machine
        with tracing.span("forward_backward", step=machine.totals["steps"] + 1, batches=len(batches)):
            figures = self.compute.compute(batches, machine.version, machine.totals["steps"] + 1)
            if batches:
                self.compute_delay.after_step(time.perf_counter() - started)
        return figures

    def _step(self, received: Received) -> Received:
        """Compute the handed batches' gradient, push it and settle the reply; returns what to work on next (the
        reply, or after a push lost with a session the pull that followed registering again)."""
        machine, compute, connections = self.machine, self.compute, self.connections
        batches = list(received.message.work.batches)
        started = time.perf_counter()
        loss, correct, _ = self._compute(batches, started)
        computed = time.perf_counter()
        compute.reach_step(machine.totals["steps"] + 1)
        with tracing.span("compress"):
            payloads = machine.encode(compute.gradients(batches))  # no batches: a flush of what error feedback carries
        compressed = time.perf_counter()
        request = machine.request(
            batches,
            loss=loss,
            correct=correct,
            gradient_time_s=computed - started,
            compression_time_s=compressed - computed,
        )
        times, buffers = (computed - started, compressed - computed, compressed), compute.buffers_to_send(batches)
        outcome = connections.push_step(machine, request, payloads, buffers, times, traced=True)
        if isinstance(outcome, Rejoined):
            return self._pulled(outcome.work)
        tracing.record("step", started, time.perf_counter(), step=machine.totals["steps"])
        return outcome

    def _step_streamed(self, received: Received) -> Received:
        """:meth:`_step` communicating while it computes (``system.streaming``, :mod:`src.ps.worker.streaming`).

        The forward takes each layer's parameters as the previous reply brings them; backward hands each gradient
        to the push as it is ready, and the push's thread compresses and sends it meanwhile (each shard's slices to
        that shard); after backward the push's message follows, and the step settles on the reply's head (a sharded
        server's: once the commit and the pulls brought every slice). A previous reply that broke off after its head
        is pulled, and the same work computed again.
        """
        machine, compute, connections, streamed = self.machine, self.compute, self.connections, self.streamed
        batches = list(received.message.work.batches)
        self._generation += 1
        gradient_of = partial(compute.gradient, batches=batches)
        pieced = self.pipelined  # large parts in pieces only for a server that reads them as they come
        push = connections.open_push(
            machine, streamed, gradient_of, compute.names, generation=self._generation, pieced=pieced, traced=True
        )
        waited_before = streamed.waited_s
        started = time.perf_counter()
        streamed.begin_push(push)
        try:
            loss, correct, _ = self._compute(batches, started)
        except ReplyBroken as broken:  # the previous reply's tensors stopped coming: pull them, compute again
            self._abort(broken)
            logger.warning("worker %d: %s; pulling the parameters", self.worker_id, broken)
            outcome = connections.run(machine.pull_parameters())
            return self._pulled(outcome.work if isinstance(outcome, Rejoined) else received)
        except BaseException as exc:
            self._abort(exc)
            raise
        streamed.end_backward()
        computed = time.perf_counter()
        forward_waits = streamed.waited_s - waited_before  # exposed: the forward waited for parameters
        compute.reach_step(machine.totals["steps"] + 1)
        request = machine.request(
            batches, loss=loss, correct=correct, gradient_time_s=computed - started - forward_waits
        )
        times = (computed - started - forward_waits, computed, forward_waits)
        buffers = compute.buffers_to_send(batches)
        outcome, head_in = connections.close_push(machine, streamed, push, request, buffers, times, traced=True)
        if isinstance(outcome, Rejoined):
            return self._pulled(outcome.work)
        tracing.record("step", started, head_in, step=machine.totals["steps"])
        return outcome

    def _abort(self, error: BaseException) -> None:
        """The step is given up before its push went out: the push's threads stop waiting for its parts."""
        self.streamed.end_backward()
        self.connections.abort_streams(error)


__all__ = ["IncarnationRevoked", "Worker"]
