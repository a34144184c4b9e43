"""What a simulated worker of a virtual-time run is wired to: its run, the server shards it calls, its launcher.

Each is a protocol (:class:`WorkerRun`, :class:`ServerCalls`, :class:`ShardCalls`, :class:`ProcessEnds`), so
:mod:`src.virtual.worker` needs neither :mod:`src.virtual.run` nor :mod:`src.virtual.server`, which import it:
:class:`~src.virtual.run.VirtualRun`, :class:`~src.virtual.server.VirtualServer`,
:class:`~src.virtual.follower.VirtualFollower` and :class:`~src.virtual.launcher.VirtualLauncher` are the ones a run
builds. The ``worker`` they take is the :class:`~src.virtual.worker.VirtualWorker` that calls them.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from torch import nn
from torch.utils.data import TensorDataset

from src.common.clock import VirtualClock
from src.config import Config
from src.emulation.cost_model import CostModel
from src.emulation.event_loop import EventLoop
from src.ps.shards.placement import Placement
from src.virtual.layers import GradientOrder, LayerProfile
from src.virtual.timelines import VirtualTimelines

Handler = Callable[[Any, bytes], None]
"""A server's handler of one message: the call it arrived on, and its bytes."""


class ShardCalls(Protocol):
    """What a simulated worker calls on every server shard (:class:`src.virtual.server.VirtualServer` and
    :class:`src.virtual.follower.VirtualFollower` are ones): Push (a sharded run's held push, or commit) and Pull."""

    serve_pull: Handler
    serve_push: Handler

    def call(
        self,
        worker: Any,
        data: bytes,
        handle: Handler,
        on_reply: Callable[[bytes], None],
        on_error: Callable[[str, str], None],
        *,
        wait_for_server: bool = False,
        sent: Callable[[], None] | None = None,
    ) -> None: ...

    def send_part(self, worker: Any, push: Any, body: bytes, sent: Callable[[], None]) -> None: ...

    def serve_streamed_push(self, push: Any) -> Handler: ...


class ServerCalls(ShardCalls, Protocol):
    """What a simulated worker calls on the simulated server (shard 0 of a sharded run; :class:`VirtualServer
    <src.virtual.server.VirtualServer>` is one): every call."""

    serve_register: Handler
    serve_heartbeat: Handler
    serve_finish: Handler


class ProcessEnds(Protocol):
    """What a simulated worker tells its launcher (:class:`src.virtual.launcher.VirtualLauncher` is one)."""

    def process_ended(self, worker: Any, exit_description: str) -> None: ...


class WorkerRun(Protocol):
    """What a simulated worker reads from its run (:class:`src.virtual.run.VirtualRun` is one): the config, the
    clock and cost model, the shared compute model and data, the server and launcher it talks to, and with several
    server shards their placement and every shard (shard 0, the server, first; ``placement`` ``None``: one server)."""

    config: Config
    cost: CostModel
    loop: EventLoop
    clock: VirtualClock
    tensorboard: bool
    compute_wall_s: float
    timelines: VirtualTimelines
    compute_model: nn.Module
    train_set: TensorDataset
    server: ServerCalls
    launcher: ProcessEnds
    placement: Placement | None
    shards: list[ShardCalls]
    layers: LayerProfile | None
    gradient_order: GradientOrder | None


__all__ = ["Handler", "ProcessEnds", "ServerCalls", "ShardCalls", "WorkerRun"]
