"""The parameter server at the wire's limit, per transport: a push round trip against raw TCP and gRPC
echoes of the same bytes plus the optimizer step, one server's ceiling in pushes/s, and training
samples/s against DDP. ``scripts/bench_ps.py`` runs it; its ``--help`` says what each figure means.

One module a part, ``run_benchmark`` here runs the ones asked for:

* ``round_trips``: a push round trip per transport and size against its references (``bench_round_trips``);
* ``references``: those references, both ends: the raw TCP echo, the stepping echo, the gRPC echo, torch's step;
* ``ceiling``: one server's pushes/s from a few counts of light clients (``bench_ceiling``);
* ``training``: samples/s of PS runs against DDP (``bench_training``);
* ``common``: what the round trips and the ceiling share: the model, the server's config, a server in a
  spawned process, the core timed per push, a client's push.

Servers, clients and training runs are spawned processes (gRPC does not survive fork): their targets are
top-level functions of these modules.
"""

from __future__ import annotations

import os

from src.benchmarks.ps.ceiling import bench_ceiling
from src.benchmarks.ps.round_trips import bench_round_trips
from src.benchmarks.ps.training import bench_training

__all__ = ["bench_ceiling", "bench_round_trips", "bench_training", "run_benchmark"]


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
    ceiling: bool = True,
    training: bool = True,
) -> dict:
    """The sections asked for (``round_trips``, ``ceiling``, ``training``) with the machine's load around them."""
    from src.transport.grpc import reuse_freed_memory

    reuse_freed_memory()  # the client side, as run_worker does (the echo clients share this process)
    result: dict = {"machine": f"{os.cpu_count()} CPUs", "load_average_before": os.getloadavg()[0]}
    if round_trips:
        result["round_trips"] = [
            bench_round_trips(transport, size, repeats) for size in sizes_mb for transport in transports
        ]
    if ceiling:
        result["ceiling"] = [bench_ceiling(transport, ceiling_clients, ceiling_seconds) for transport in transports]
    if training:
        result["training"] = bench_training(num_epochs, batch_size, transports, training_repeats)
    result["load_average_after"] = os.getloadavg()[0]
    return result
