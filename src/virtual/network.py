"""The network of a virtual run with several server shards: each shard's NIC and each worker's links, shared fairly.

With one server (:class:`~src.virtual.server.VirtualServer`), a worker has one message in flight at a time, so a
message crosses the server NIC (:class:`~src.emulation.event_loop.SharedLink`) capped at its worker's link rate:
:class:`OneServerLinks`. With ``system.num_servers`` = S > 1 shards, a worker sends its slices to every shard *at
once* (:mod:`src.ps.shards.rounds`), so its S messages share its own uplink while each also shares its shard's NIC
with the other workers' messages: a transfer crosses two links at once, each shared by different transfers.
:class:`FairNetwork` rates such transfers max-min fairly over every link they cross (progressive filling: every
transfer's rate rises together until a link it crosses is full; the transfers of a full link keep that rate, the
others go on rising), recomputed whenever a transfer starts or ends or a capacity changes. One link with one
transfer per private link is :class:`~src.emulation.event_loop.SharedLink`'s fair share with caps
(``tests/test_virtual_shards.py`` checks that it gives the same times).

:class:`ShardLinks` is shard k's view of it: its NIC (``emulation.server_mbps`` each way, its own), and every
worker's uplink and downlink (``emulation.uplink_mbps`` / ``downlink_mbps``; an ``uplink_schedule`` sets a worker's
uplink to the rate in force when it sends, for its messages in flight too).

Pure: no torch, no I/O, no threads.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from src.emulation.cost_model import CostModel
from src.emulation.event_loop import EventLoop, SharedLink

_TIGHT = 1e-12
"""Relative tolerance by which two links' fair shares count as equal (float rounding of capacity / count)."""


@dataclass(eq=False)
class _Transfer:
    remaining_bits: float
    links: tuple[int, ...]
    done: Callable[[], None]
    rate_bps: float = 0.0


class FairNetwork:
    """Links of given capacities, and transfers that each cross several of them at once, shared max-min fairly
    (see the module docstring). ``done`` is called when a transfer's last bit is through; the caller reads the
    loop's clock there."""

    EPSILON_BITS = 1e-3  # a transfer this close to its end is done (float rounding of rate * time)

    def __init__(self, loop: EventLoop):
        self.loop = loop
        self._capacity: list[float | None] = []
        self._transfers: dict[int, _Transfer] = {}  # by start order: rates and ends do not depend on memory
        self._ids = itertools.count()
        self._updated = 0.0
        self._timer = 0  # generation of the pending completion event

    @property
    def active(self) -> int:
        return len(self._transfers)

    def link(self, capacity_bps: float | None) -> int:
        """A new link of ``capacity_bps`` (``None``: not limited); its id for :meth:`send`."""
        self._capacity.append(capacity_bps)
        return len(self._capacity) - 1

    def capacity(self, link: int) -> float | None:
        return self._capacity[link]

    def set_capacity(self, link: int, capacity_bps: float | None) -> None:
        """Change a link's capacity from now on (the transfers crossing it are rated again)."""
        if self._capacity[link] == capacity_bps:
            return
        self._advance()
        self._capacity[link] = capacity_bps
        self._reschedule()

    def send(self, bits: float, links: Sequence[int], done: Callable[[], None]) -> None:
        """Start a transfer of ``bits`` across every link in ``links`` at once; ``done`` when it is through."""
        if bits <= 0 or all(self._capacity[link] is None for link in links):
            self.loop.after(0.0, done)  # nothing limits it: through at once
            return
        self._advance()
        self._transfers[next(self._ids)] = _Transfer(float(bits), tuple(links), done)
        self._reschedule()

    def _advance(self) -> None:
        elapsed = self.loop.now - self._updated
        if elapsed > 0:
            for transfer in self._transfers.values():
                transfer.remaining_bits -= transfer.rate_bps * elapsed
        self._updated = self.loop.now

    def _allocate(self) -> None:
        """Max-min fair rates by progressive filling."""
        rising = list(self._transfers.values())
        used: Counter[int] = Counter()  # bits/s of each link taken by the transfers whose rate is settled
        while rising:
            crossing = Counter(link for t in rising for link in t.links if self._capacity[link] is not None)
            if not crossing:  # no limited link left on them (a capacity was lifted): through at once
                for transfer in rising:
                    transfer.rate_bps = float("inf")
                return
            shares = {link: (self._capacity[link] - used[link]) / count for link, count in sorted(crossing.items())}
            level = max(min(shares.values()), 0.0)
            full = {link for link, share in shares.items() if share <= level * (1 + _TIGHT)}
            still = []
            for transfer in rising:
                if full.intersection(transfer.links):
                    transfer.rate_bps = level
                    for link in transfer.links:
                        used[link] += level
                else:
                    still.append(transfer)
            rising = still

    def _reschedule(self) -> None:
        """Rates for the active transfers, and an event at the next one's end."""
        self._allocate()
        self._timer += 1
        if self._transfers:
            soonest = min(self._time_left(t) for t in self._transfers.values())
            generation = self._timer
            self.loop.after(soonest, lambda: self._complete(generation))

    @staticmethod
    def _time_left(transfer: _Transfer) -> float:
        if transfer.rate_bps == float("inf"):
            return 0.0
        return max(transfer.remaining_bits, 0.0) / transfer.rate_bps if transfer.rate_bps > 0 else float("inf")

    def _complete(self, generation: int) -> None:
        if generation != self._timer:
            return  # rates changed since this event was scheduled
        self._advance()
        finished = [
            key
            for key, t in self._transfers.items()
            if t.remaining_bits <= self.EPSILON_BITS or t.rate_bps == float("inf")
        ]
        if not finished:  # rounding left a sliver: the soonest transfer is the one that ended
            finished = [min(self._transfers, key=lambda key: self._time_left(self._transfers[key]))]
        callbacks = [self._transfers.pop(key).done for key in finished]
        self._reschedule()
        for callback in callbacks:
            callback()


class ServerLinks(Protocol):
    """How a simulated server's messages cross the network: to it from a worker, and back."""

    def upload(self, worker: int, bits: float, uplink_bps: float | None, done: Callable[[], None]) -> None:
        """``bits`` from ``worker`` (whose uplink runs at ``uplink_bps`` now) to the server; ``done`` on arrival."""
        raise NotImplementedError

    def download(self, worker: int, bits: float, downlink_bps: float | None, done: Callable[[], None]) -> None:
        """``bits`` from the server to ``worker`` (downlink ``downlink_bps``); ``done`` on arrival."""
        raise NotImplementedError


class OneServerLinks:
    """One server's NIC each way (:class:`~src.emulation.event_loop.SharedLink`), each message capped at its
    worker's link: a worker of an unsharded run has one message in flight at a time."""

    def __init__(self, loop: EventLoop, server_bps: float | None):
        self.nic_in = SharedLink(loop, server_bps)
        self.nic_out = SharedLink(loop, server_bps)

    def upload(self, worker: int, bits: float, uplink_bps: float | None, done: Callable[[], None]) -> None:
        self.nic_in.send(bits, uplink_bps, done)

    def download(self, worker: int, bits: float, downlink_bps: float | None, done: Callable[[], None]) -> None:
        self.nic_out.send(bits, downlink_bps, done)


class ShardLinks:
    """Shard ``k``'s NIC each way in the run's :class:`FairNetwork`, with every worker's uplink and downlink."""

    def __init__(self, network: FairNetwork, nic_in: int, nic_out: int, uplinks: list[int], downlinks: list[int]):
        self.network = network
        self.nic_in, self.nic_out = nic_in, nic_out
        self.uplinks, self.downlinks = uplinks, downlinks

    def upload(self, worker: int, bits: float, uplink_bps: float | None, done: Callable[[], None]) -> None:
        uplink = self.uplinks[worker]
        self.network.set_capacity(uplink, uplink_bps)  # the rate in force now (emulation.uplink_schedule)
        self.network.send(bits, (uplink, self.nic_in), done)

    def download(self, worker: int, bits: float, downlink_bps: float | None, done: Callable[[], None]) -> None:
        self.network.send(bits, (self.nic_out, self.downlinks[worker]), done)


def shard_links(loop: EventLoop, cost: CostModel, num_shards: int) -> list[ShardLinks]:
    """The network of a run of ``num_shards`` shards: each its own NIC of ``cost.server_bps`` each way, the
    workers' links shared by every shard; shard k's view at index k."""
    network = FairNetwork(loop)
    uplinks = [network.link(w.uplink_bps) for w in cost.workers]
    downlinks = [network.link(w.downlink_bps) for w in cost.workers]
    return [
        ShardLinks(network, network.link(cost.server_bps), network.link(cost.server_bps), uplinks, downlinks)
        for _ in range(num_shards)
    ]
