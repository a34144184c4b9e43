"""connect() and WorkerClient: one worker process's membership in a parameter-server run.

The client registers with the server (a new incarnation with its own session secret), learns the run's config
(mode, compression, heartbeat interval) and sends a heartbeat every ``system.heartbeat_interval`` from a background
thread. It carries the worker's step machine (:class:`~src.ps.worker.machine.StepMachine`, the one our own workers
carry): every call after registration carries the session, so a late call from a failed incarnation is refused; a
server that lost the session (it restarted; the transport waits out the restart) or a shard starting again makes
the client register again, and so does a server that declared this incarnation failed while it was alive (a
partition, a long pause), up to ``max_rejoins`` times (default the server's ``system.max_rejoins``); then the call
raises :class:`~src.ps.worker.membership.IncarnationRevoked`. A push whose reply was lost is committed or rolled back
by what the registration says.

It moves no tensors by itself: :class:`~torch_asgc.model.DistributedModel` pulls and initializes through it,
:class:`~torch_asgc.optim.DistributedOptimizer` pushes through it (a server with ``system.streaming``: streamed
pushes, one per shard, each on that shard's push thread, :class:`~src.ps.worker.connections.Connections`).
``close()`` (or the end of a ``with`` block) tells the server this worker is done (``Finish``, with its totals for the
run summary); in sync mode the barrier goes on without it.

    with connect("127.0.0.1:50051") as client:      # token: $DTS_AUTH_TOKEN; "tcp://127.0.0.1:50051": TCP transport
                                                      # a sharded server: connect(["h1:p1", "h2:p2"]), shard 0 first
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), client)
        ...                                           # the user's own loop
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Sequence

from src import parameter_server_pb2 as pb
from src.config import Config, SetupError, SystemConfig, validate_config
from src.ps.worker import Connections, Exchange, IncarnationRevoked, Membership, Rejoins, StepMachine
from src.ps.worker.run_config import check_shard_addresses
from src.transport.clients import make_client, transport_of
from src.transport.settings import AUTH_TOKEN_ENV

logger = logging.getLogger(__name__)


class WorkerClient:
    """One worker's connection to the parameter server; see the module docstring. Use :func:`connect`.

    Attributes:
        worker_id: this worker's id (the server's choice when :func:`connect` got none).
        config: the run's config as the server sent it (``config.system.aggregation_mode``, compression, ...).
        model: the :class:`~torch_asgc.model.DistributedModel` using this client, once there is one.
        machine: the worker's step machine (its ``totals``: steps, samples, times, bytes, sent with heartbeats).
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        token: str | None = None,
        worker_id: int | None = None,
        tls_ca_file: str | None = None,
        connect_timeout_s: float = 300.0,
        max_rejoins: int | None = None,
        transport: str | None = None,
    ):
        token = token or os.environ.get(AUTH_TOKEN_ENV)
        if not token:
            raise SetupError(f"no auth token: pass token=... to connect() or set ${AUTH_TOKEN_ENV}")
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise SetupError("connect(): no address (give the server's host:port, or every shard's, shard 0 first)")
        located = [transport_of(each, transport) for each in addresses]
        if len({kind for _, kind in located}) > 1:
            raise SetupError(f"connect({addresses}): the shards' addresses name different transports")
        self.token = token
        self.address = located[0][0]
        system = SystemConfig(tls_ca_file=tls_ca_file)
        clients = [
            make_client(each, transport=kind, token=token, system=system, connect_timeout_s=connect_timeout_s)
            for each, kind in located
        ]
        self.connections = Connections(clients, name=f"asgc-worker-{worker_id if worker_id is not None else 'new'}")
        self.membership = Membership(worker_id)
        self.machine: StepMachine | None = None
        self.config: Config | None = None
        self.model: Any = None
        self._max_rejoins = max_rejoins
        self._started = time.perf_counter()
        self.closed = False

    # ------------------------------------------------------------------------- who it is

    @property
    def transport(self) -> Any:
        """The server's connection (shard 0's, of a sharded server)."""
        return self.connections.clients[0]

    @property
    def shard_transports(self) -> list[Any]:
        """A sharded server: the connections to shards 1, 2, ..."""
        return self.connections.clients[1:]

    @property
    def sharded(self) -> bool:
        """Whether the server is split across shards (this client holds a connection to each)."""
        return len(self.connections.clients) > 1

    @property
    def worker_id(self) -> int | None:
        return self.membership.worker_id

    @property
    def incarnation(self) -> int:
        return self.membership.incarnation

    @property
    def registration(self) -> pb.RegisterReply | None:
        return self.membership.registration

    @property
    def rejoins(self) -> Rejoins | None:
        """The budget of rejoins after a revocation (``max_rejoins``; set at the first registration)."""
        return self.membership.rejoins

    @property
    def mode(self) -> str:
        """``sync`` or ``async``: the server's aggregation mode."""
        return self.config.system.aggregation_mode

    @property
    def totals(self) -> dict[str, Any]:
        """This process's running totals (steps, samples, rejections, times, bytes), sent with heartbeats."""
        return self.machine.totals

    # ------------------------------------------------------------------------- lifecycle

    def open(self) -> "WorkerClient":
        """Register and start heartbeats (:func:`connect` calls it).

        Raises:
            SetupError: the server runs another number of shards than the addresses given.
        """
        registration = self.run(self.membership.register())
        self.config = validate_config(json.loads(registration.run_config_json))
        system = self.config.system
        check_shard_addresses(system.num_servers, len(self.connections.clients), "connect() to")
        max_rejoins = system.max_rejoins if self._max_rejoins is None else self._max_rejoins
        self.membership.rejoins = Rejoins(self.worker_id, max_rejoins)
        self.machine = StepMachine(self.membership, system, planned_work=False, stats=self.stats)
        name = f"asgc-worker-{self.worker_id}-heartbeat"
        self.connections.start_heartbeats(self.membership, self.stats, system.heartbeat_interval, name)
        return self

    def run(self, exchange: Exchange) -> Any:
        """Carry one of the step machine's exchanges on this client's connections (blocking)."""
        return self.connections.run(exchange)

    def close(self) -> None:
        """Leave the run: Finish with this worker's totals, stop heartbeats, close the channel (idempotent).

        Raises:
            CallError: the server refused Finish (e.g. this incarnation was failed meanwhile).
        """
        if self.closed:
            return
        self.closed = True
        try:
            # a streamed push still taking parts (a backward with no step after it) is given up, and the last
            # reply's tensors are waited for (so the totals count every byte)
            self.connections.end_streams(SetupError("the client closed before the step that would end this push"))
            self.run(self.machine.finish(self.stats))
        finally:
            self.connections.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
            return
        try:  # leaving because of an error: do not hide it behind a failed Finish
            self.close()
        except Exception as exc:  # noqa: BLE001
            logger.warning("worker %s: could not leave the run cleanly (%s)", self.worker_id, exc)

    def stats(self) -> pb.WorkerStats:
        """This process's running totals (read by the heartbeat thread too)."""
        return self.connections.stats(self.machine, time.perf_counter() - self._started)


def connect(
    address: str | Sequence[str],
    token: str | None = None,
    worker_id: int | None = None,
    *,
    tls_ca_file: str | None = None,
    connect_timeout_s: float = 300.0,
    max_rejoins: int | None = None,
    transport: str | None = None,
) -> WorkerClient:
    """Join the parameter-server run at ``address`` as one worker; a context manager (``close()`` on exit).

    Args:
        address: the server's ``host:port``, or ``tcp://host:port`` / ``grpc://host:port`` naming the transport; a
            sharded server's: a list of every shard's, shard 0 first (``connect(["h1:p1", "h2:p2"])``).
        token: the run's auth token (default ``$DTS_AUTH_TOKEN``).
        worker_id: ``0..num_workers-1``; ``None`` lets the server pick the lowest free id.
        tls_ca_file: verify a TLS server against this CA (or its self-signed certificate).
        connect_timeout_s: how long to wait for the server to come up (and to come back after a restart).
        max_rejoins: times this process registers again by itself after the server declared it failed
            while it was alive (default: the server's ``system.max_rejoins``).
        transport: ``"grpc"`` (default) or ``"tcp"``: the server's ``system.transport``, when ``address`` names none.

    Raises:
        SetupError: no token.
        CallError: the server refused (wrong token: UNAUTHENTICATED; no free id: RESOURCE_EXHAUSTED) or was not there
            within ``connect_timeout_s`` (DEADLINE_EXCEEDED).
    """
    client = WorkerClient(
        address,
        token=token,
        worker_id=worker_id,
        tls_ca_file=tls_ca_file,
        connect_timeout_s=connect_timeout_s,
        max_rejoins=max_rejoins,
        transport=transport,
    )
    try:
        return client.open()
    except BaseException:
        client.connections.close()
        raise


__all__ = ["IncarnationRevoked", "WorkerClient", "connect"]
