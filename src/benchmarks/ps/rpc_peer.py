"""The parameter server a PyTorch user would write instead of ours: torch.distributed.rpc, in the tutorial's design.

The design is that of PyTorch's tutorial "Implementing Batch RPC Processing Using Asynchronous Executions"
(pytorch/examples, ``distributed/rpc/batch/parameter_server.py``), written here for the bench against it
(:mod:`src.benchmarks.ps.peer`):

* one server process holds the model and an SGD optimizer;
* each trainer calls ``rpc_sync(update_and_fetch, gradients)`` once a step;
* an ``@rpc.functions.async_execution`` function adds the gradients under a lock; the last trainer of the step
  triggers the mean, the optimizer's step and the one future that answers every trainer with the parameters.

Like for like with our sync PS, so that only the machinery differs:

* **The same job:** the model initialised from ``training.seed`` (:func:`src.trainer.model_from_config`); trainer
  k takes the batches our work plan gives worker k, in the same order (:func:`src.training.data.make_shards`);
  the step is the mean of the trainers' gradients, ``(g1 + g2) / 2``, bit for bit our server's sample-weighted
  mean at equal batches, stepped by the same optimizer (:func:`src.training.optimizers.optimizer_from_config`,
  fused). So its final loss and accuracy equal our sync run's to the last digit.
* **The same wire:** TensorPipe restricted to TCP (the ``uv`` transport and the ``basic`` channel: shared memory
  would not be a wire), on loopback.
* **The same threads:** one compute thread per process (``torch.set_num_threads(1)``), as the local launcher
  gives each of a 2-worker run's processes on 2 cores.
* **The same allocator:** each process keeps and reuses freed memory
  (:func:`src.common.memory.reuse_freed_memory`), as each of ours does. Without it the trainers, which run in an RPC
  thread and so in a malloc arena of their own that hands emptied heaps back to the kernel, fault their pages again
  every step: simple_cnn's forward and backward took 15.7-17.2 ms there against 12.8-13.2 with it, and the peer ran
  at 2,510-2,731 samples/s against 3,105-3,223 (two runs each, in turns).

Its clock runs from the moment every trainer has built its model and loaded its data to the last trainer's last
reply, as ours runs from the first work handed out (after the workers registered) to the last update applied.
"""

from __future__ import annotations

import queue
import statistics
import tempfile
import threading
import time
from typing import Any

import torch
from torch.distributed import rpc

SERVER = "ps"
TRAINER = "trainer{}"
JOIN_TIMEOUT_S = 900.0


class _Server:
    """The model, its optimizer, and the step's gradient sum (one per parameter) under a lock."""

    def __init__(self, config: Any, trainers: int):
        from src.trainer import model_from_config
        from src.training.optimizers import optimizer_from_config

        self.model = model_from_config(config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optimizer_from_config(config, self.params, fused=True)
        self.trainers = trainers
        self.sums = [torch.zeros_like(p) for p in self.params]
        self.arrived = 0
        self.lock = threading.Lock()
        self.future: torch.futures.Future = torch.futures.Future()
        self.phases: dict[str, list[float]] = {"add": [], "close": []}
        """Seconds of each push's handling: ``add`` (a push that waits for others), ``close`` (the last, which
        also averages and steps)."""


@rpc.functions.async_execution
def _update_and_fetch(server_rref, gradients: list[torch.Tensor]) -> torch.futures.Future:
    """Add a trainer's gradients; the last of the step averages, steps and answers everyone with the parameters."""
    server: _Server = server_rref.local_value()
    started = time.perf_counter()
    with server.lock:
        for total, gradient in zip(server.sums, gradients):
            total.add_(gradient)
        server.arrived += 1
        future = server.future
        closes = server.arrived == server.trainers
        if closes:
            for param, total in zip(server.params, server.sums):
                param.grad = total.div_(server.trainers)
            server.optimizer.step()
            server.sums = [torch.zeros_like(p) for p in server.params]
            server.arrived = 0
            server.future = torch.futures.Future()
        server.phases["close" if closes else "add"].append(time.perf_counter() - started)
        if closes:
            future.set_result([p.detach() for p in server.params])
    return future


_TRAINER: dict[str, Any] = {}
"""A trainer process's model, parameters, data and batches, made by :func:`_prepare` before the clock starts."""


def _prepare(worker: int, overrides: dict[str, Any]) -> None:
    """Trainer ``worker``: build the model and load the data; its batches of every epoch, as our work plan has them."""
    from src.config import load_config
    from src.trainer import load_split, model_from_config
    from src.training.data import make_shards

    config = load_config(overrides=overrides)
    t = config.training
    model = model_from_config(config)
    train = load_split(config, "train")
    batches = []
    for epoch in range(t.num_epochs):
        (shard,) = [s for s in make_shards(len(train), config.system.num_workers, epoch, t.seed) if s.owner == worker]
        batches += list(shard.batches(t.batch_size))
    _TRAINER.update(model=model, params=[p for p in model.parameters() if p.requires_grad], train=train)
    _TRAINER["batches"] = batches


def _train(server_rref) -> tuple[int, dict[str, list[float]]]:
    """The prepared trainer's batches, one push and one fetch each; returns the samples and the seconds of each
    step's phases (``forward_backward``, ``update_and_fetch``: the call, ``copy``: the reply into the model)."""
    from src.trainer import forward_backward

    model, params, train = _TRAINER["model"], _TRAINER["params"], _TRAINER["train"]
    samples, phases = 0, {"forward_backward": [], "update_and_fetch": [], "copy": []}
    for indices in _TRAINER["batches"]:
        images, labels = train.batch(indices)
        for param in params:
            param.grad = None
        started = time.perf_counter()
        forward_backward(model, images, labels)
        computed = time.perf_counter()
        fresh = rpc.rpc_sync(server_rref.owner(), _update_and_fetch, args=(server_rref, [p.grad for p in params]))
        answered = time.perf_counter()
        with torch.no_grad():
            for param, value in zip(params, fresh):
                param.copy_(value)
        for phase, seconds in zip(phases, (computed - started, answered - computed, time.perf_counter() - answered)):
            phases[phase].append(seconds)
        samples += len(indices)
    return samples, phases


def _rank(rank: int, world: int, rendezvous: str, overrides: dict[str, Any], results) -> None:
    """One process: the server (rank 0, which also starts the trainers and evaluates) or a trainer."""
    from src.common.memory import reuse_freed_memory

    reuse_freed_memory()  # as every process of ours does: the allocator is not what is compared
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{rendezvous}", _transports=["uv"], _channels=["basic"], rpc_timeout=JOIN_TIMEOUT_S
    )
    name = SERVER if rank == 0 else TRAINER.format(rank - 1)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    if rank == 0:
        from src.config import load_config
        from src.trainer import evaluate, load_split

        config = load_config(overrides=overrides)
        server = _Server(config, world - 1)
        server_rref = rpc.RRef(server)
        trainers = [TRAINER.format(k) for k in range(world - 1)]
        torch.futures.wait_all([rpc.rpc_async(name, _prepare, args=(k, overrides)) for k, name in enumerate(trainers)])
        started = time.perf_counter()
        trained = torch.futures.wait_all([rpc.rpc_async(name, _train, args=(server_rref,)) for name in trainers])
        train_time = time.perf_counter() - started
        samples = sum(count for count, _ in trained)
        trainer_phases = {phase: [s for _, phases in trained for s in phases[phase]] for phase in trained[0][1]}
        loss, accuracy = evaluate(server.model, load_split(config, "test"))
        results.put(
            {
                "throughput_samples_per_s": samples / train_time,
                "train_time_s": train_time,
                "samples_processed": samples,
                "final_loss": loss,
                "final_accuracy": accuracy,
                "phases_ms": {
                    "trainer": _medians_ms(trainer_phases),
                    "server": _medians_ms(server.phases),
                },
            }
        )
    rpc.shutdown()


def _medians_ms(phases: dict[str, list[float]]) -> dict[str, float]:
    return {phase: round(1000 * statistics.median(seconds), 2) for phase, seconds in phases.items() if seconds}


def run_rpc_peer(overrides: dict[str, Any]) -> dict[str, Any]:
    """A sync run of the peer with ``system.num_workers`` trainers on the config ``overrides`` give; its summary
    (``throughput_samples_per_s``, ``final_loss``, ``final_accuracy``, ``samples_processed``, ``train_time_s``, and
    ``phases_ms``: the median milliseconds of a step's phases, the trainers' and the server's)."""
    from src.common.child_processes import process_context
    from src.config import load_config

    world = load_config(overrides=overrides).system.num_workers + 1
    context = process_context()
    results = context.Queue()
    summary = None
    with tempfile.TemporaryDirectory() as folder:  # the ranks meet in a file: no port to probe and lose
        rendezvous = f"{folder}/rendezvous"
        processes = [
            context.Process(target=_rank, args=(rank, world, rendezvous, overrides, results)) for rank in range(world)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            while summary is None:
                try:
                    summary = results.get(timeout=1.0)
                except queue.Empty:
                    failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                    if failed or time.monotonic() > deadline:
                        raise RuntimeError(f"the torch.distributed.rpc peer failed (exit codes {failed})") from None
        finally:
            for process in processes:
                if summary is None:
                    process.kill()
                process.join(60)
                if process.is_alive():
                    process.kill()
                    process.join()
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"the torch.distributed.rpc peer's processes exited with {failed}")
    return summary
