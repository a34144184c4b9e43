"""The parameter server at the wire's limit, per transport: a push round trip against raw TCP and gRPC
echoes of the same bytes plus the optimizer step, one server's ceiling in pushes/s, one server against two
server shards (on loopback, and across network namespaces with shaped links), and training samples/s against
DDP. ``scripts/bench_ps.py`` runs it; its ``--help`` says what each figure means.

One module a part, ``run_benchmark`` here runs the ones asked for:

* ``round_trips``: a push round trip per transport and size against its references (``bench_round_trips``), and
  one follower shard's link per sync step of 2 shards against the same references (``bench_shard_round_trip``);
* ``references``: those references, both ends: the raw TCP echo, the stepping echo, the gRPC echo, torch's step;
* ``ceiling``: one server's pushes/s from a few counts of light clients (``bench_ceiling``);
* ``shards``: pushes/s and GB/s into one server and into two server shards from light clients (``bench_shards``);
* ``netns``: samples/s of a sync run across network namespaces with 1 and 2 shards, each server's link shaped by
  ``tc`` (``bench_shards_netns``);
* ``training``: samples/s of PS runs against DDP (``bench_training``);
* ``common``: what the round trips and the ceiling share: the model, the server's config, a server in a
  spawned process, the core timed per push, a client's push.

Servers, clients and training runs are spawned processes (gRPC does not survive fork): their targets are
top-level functions of these modules.
"""

from __future__ import annotations

import os

from src.benchmarks.ps.ceiling import bench_ceiling
from src.benchmarks.ps.netns import bench_shards_netns
from src.benchmarks.ps.round_trips import bench_round_trips, bench_shard_round_trip
from src.benchmarks.ps.shards import bench_shards
from src.benchmarks.ps.training import bench_training

__all__ = [
    "bench_ceiling",
    "bench_round_trips",
    "bench_shard_round_trip",
    "bench_shards",
    "bench_shards_netns",
    "bench_training",
    "run_benchmark",
]


def run_benchmark(
    transports: list[str],
    sizes_mb: list[float],
    repeats: int,
    ceiling_clients: list[int],
    ceiling_seconds: float,
    num_epochs: int,
    training_repeats: int,
    batch_size: int,
    *,
    round_trips: bool = True,
    shard_round_trips: bool = True,
    ceiling: bool = True,
    training: bool = True,
    shards: bool = True,
    shards_seconds: float = 2.0,
    shards_repeats: int = 3,
    netns: bool = True,
    netns_mbps: float = 50.0,
    netns_repeats: int = 1,
    netns_pipelined: bool = False,
    netns_virtual: bool = False,
    netns_trace_dir: str | None = None,
    crossover: bool = False,
    crossover_plot: str | None = None,
) -> dict:
    """The sections asked for (``round_trips`` and, over TCP, ``shard_round_trips``, ``ceiling``, ``shards``,
    ``shards_netns``, ``training``, ``crossover``) with the machine's load around them."""
    from src.common.memory import reuse_freed_memory

    reuse_freed_memory()  # the client side, as run_worker does (the echo clients share this process)
    result: dict = {"machine": f"{os.cpu_count()} CPUs", "load_average_before": os.getloadavg()[0]}
    if round_trips:
        result["round_trips"] = []
        if shard_round_trips and "tcp" in transports:
            result["shard_round_trips"] = []
        for size in sizes_mb:  # per size, the one-server rows and the per-shard row one after the other
            result["round_trips"] += [bench_round_trips(transport, size, repeats) for transport in transports]
            if "shard_round_trips" in result:
                result["shard_round_trips"].append(bench_shard_round_trip(size, repeats))
    if ceiling:
        result["ceiling"] = [bench_ceiling(transport, ceiling_clients, ceiling_seconds) for transport in transports]
    if shards:
        result["shards"] = [bench_shards(transport, shards_seconds, shards_repeats) for transport in transports]
    if netns:
        result["shards_netns"] = bench_shards_netns(
            netns_mbps,
            repeats=netns_repeats,
            pipelined=netns_pipelined,
            virtual=netns_virtual,
            trace_dir=netns_trace_dir,
        )
    if training:
        result["training"] = bench_training(num_epochs, batch_size, transports, training_repeats)
    if crossover:  # ~20 minutes of virtual runs: only when asked
        from src.benchmarks.ps.crossover import bench_crossover

        result["crossover"] = bench_crossover([4, 8, 16, 32, 64], [1, 2, 4, 8, 16], [1000, 10000], crossover_plot)
    result["load_average_after"] = os.getloadavg()[0]
    return result
