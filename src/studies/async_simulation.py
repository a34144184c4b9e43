"""In-process simulation of asynchronous parameter-server training, for exploring corrections fast.

N virtual workers each hold a snapshot of the parameters taken at their last pull; a virtual clock
decides who pushes next (each worker's compute time is ``slowdown_k * (1 + jitter * U)``, or
exponential). A push is the gradient of the worker's next batch of its shard (same shards, same
compression policy and error feedback as :mod:`src.worker`) at its snapshot; the server applies it
with the server-side optimizer, then the worker pulls the newest parameters. Staleness is counted
exactly as the server counts it (``version - base_version``).

This served the design-space search of docs/async.md (``scripts/async_sim.py`` is its command line):
one process at 1 thread, with a schedule under control (``uniform`` is a harsh round robin,
``exponential`` memoryless staleness, ``slowdown`` a slow worker); every claim there is confirmed
with real runs (scripts/async_study.py).
"""

from __future__ import annotations

import heapq
import json
import random
import statistics
import time
from typing import Iterator, TextIO

import torch

from src.common.seeds import derive_seed
from src.compression import decompress
from src.compressors.error_feedback import ErrorFeedback
from src.compressors.policy import policy_from_config
from src.config import Config, validate_config
from src.ps.state.staleness import LookaheadMomentum, StalenessPolicy, server_optimizer
from src.trainer import evaluate, forward_backward, model_from_config
from src.training.data import load_dataset, make_shards, steps_per_epoch


# ---- design-space variants measured in docs/async.md (the one chosen is src.ps.state.staleness.LookaheadMomentum)
class MomentumVariant:
    """Variants of momentum for async pushes, for the design-space comparison (``--variant`` JSON):

    ``per_worker`` (one buffer per worker, else one shared), ``lookahead`` (pulls get
    ``params - lr * momentum * sum(buffers)``), ``own`` (the pulling worker's buffer counts in its
    lookahead: DANA's Nesterov-like choice; without it only the others' pending momentum), ``lr_scale``
    (per-push learning rate = lr * lr_scale). ``{"lr_scale": 1/N}`` is :class:`LookaheadMomentum`.
    """

    def __init__(
        self, params, *, num_workers, lr, momentum, weight_decay=0.0, lookahead=True, per_worker=True, own=True
    ):
        self.own = own
        self.params = list(params)
        self.n = num_workers if per_worker else 1
        self.lr, self.mu, self.wd, self.look = lr, momentum, weight_decay, lookahead
        self.per_worker = per_worker
        self.buffers = [[torch.zeros_like(p) for p in self.params] for _ in range(self.n)]
        self.sums = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, worker, gradients, weight=1.0):
        k = worker if self.per_worker else 0
        for p, g, v, s in zip(self.params, gradients, self.buffers[k], self.sums):
            d = g * weight
            if self.wd:
                d = d + self.wd * p
            s.sub_(v)
            v.mul_(self.mu).add_(d)
            s.add_(v)
            p.sub_(v, alpha=self.lr)

    @torch.no_grad()
    def pull_view(self, worker):
        """What ``worker`` pulls: the parameters, or their lookahead."""
        if not self.look:
            return [p.detach().clone() for p in self.params]
        if not self.own:
            return [p - self.lr * self.mu * (s - v) for p, s, v in zip(self.params, self.sums, self.buffers[worker])]
        return [p - self.lr * self.mu * s for p, s in zip(self.params, self.sums)]


class AsyncSimulation:
    """One simulated async run: the server's model and optimizer, each worker's replica, shard and clock."""

    def __init__(self, config: Config, *, schedule: str, jitter: float, slowdown: float, sim_seed: int, variant):
        t, system = config.training, config.system
        self.config, self.n = config, system.num_workers
        self.schedule, self.jitter, self.slowdown = schedule, jitter, slowdown
        self.train = load_dataset(t.dataset, "train", data_dir=t.data_dir, max_samples=t.max_train_samples, seed=t.seed)
        self.test = load_dataset(t.dataset, "test", data_dir=t.data_dir, max_samples=t.max_test_samples, seed=t.seed)
        self.model = model_from_config(config)
        self.optimizer = server_optimizer(config, self.model.parameters(), fused=False)
        self.other = None  # a design-space variant instead of the server's optimizer
        if variant is not None:
            self.other = MomentumVariant(
                self.model.parameters(),
                num_workers=self.n,
                lr=t.learning_rate * variant.get("lr_scale", 1.0),
                momentum=t.momentum,
                weight_decay=t.weight_decay,
                lookahead=variant.get("lookahead", True),
                per_worker=variant.get("per_worker", True),
                own=variant.get("own", True),
            )
        self.losses: list[float] = []
        self.staleness_policy = StalenessPolicy.from_config(system)
        self.replicas = [model_from_config(config) for _ in range(self.n)]
        self.params = list(self.model.parameters())
        self.names = [name for name, _ in self.model.named_parameters()]
        self.policy = policy_from_config(system)
        self.feedback = (
            [ErrorFeedback() for _ in range(self.n)] if self.policy is not None and system.error_feedback else None
        )
        self.generators = [torch.Generator().manual_seed(derive_seed(t.seed, k)) for k in range(self.n)]
        self.rng = random.Random(sim_seed)
        self.steps = steps_per_epoch(len(self.train), self.n, t.batch_size)
        self.base_version = [0] * self.n
        self.pushes_done = [0] * self.n
        self.version, self.histogram, self.rejected = 0, {}, 0

    def batches_of(self, k: int) -> Iterator[list[int]]:
        """Worker ``k``'s batches, epoch by epoch, as many a worker as the longest shard has (empty past its end)."""
        t = self.config.training
        for epoch in range(t.num_epochs):
            shard = list(make_shards(len(self.train), self.n, epoch, t.seed)[k].batches(t.batch_size))
            for step in range(self.steps):
                yield shard[step] if step < len(shard) else []

    def duration(self, k: int) -> float:
        """Worker ``k``'s next compute time on the virtual clock (worker 0 slowed by ``slowdown``)."""
        speed = self.slowdown if k == 0 else 1.0
        if self.schedule == "exponential":
            return speed * self.rng.expovariate(1.0)
        return speed * (1.0 + self.jitter * self.rng.random())

    def gradients(self, k: int, indices: list[int]) -> list[torch.Tensor]:
        """Worker ``k``'s gradient of one batch at its snapshot, compressed with error feedback as a push is."""
        replica = self.replicas[k]
        replica.zero_grad(set_to_none=True)
        images, labels = self.train.batch(indices)
        self.losses.append(forward_backward(replica, images, labels)[0])
        gradients = []
        for name, p in zip(self.names, replica.parameters()):
            g = p.grad
            if self.policy is not None:
                compensated = self.feedback[k].compensate(name, g) if self.feedback else g
                payload = self.policy.compress(compensated, self.pushes_done[k], self.generators[k])
                if self.feedback:
                    self.feedback[k].update(name, compensated, payload)
                g = decompress(payload)
            gradients.append(g)
        return gradients

    def apply(self, k: int, gradients: list[torch.Tensor], tau: int) -> None:
        """The server's side of a push of staleness ``tau``: weighted and applied, or rejected (EF rolled back)."""
        self.histogram[tau] = self.histogram.get(tau, 0) + 1
        weight, _reason = self.staleness_policy.verdict(tau)
        if weight is None:
            self.rejected += 1
            if self.feedback:
                for name in self.names:
                    self.feedback[k].rollback(name)
        elif self.other is not None:
            self.other.step(k, gradients, weight)
            self.version += 1
        else:
            for p, g in zip(self.params, gradients):
                p.grad = g * weight if weight != 1.0 else g
            if isinstance(self.optimizer, LookaheadMomentum):
                self.optimizer.step(worker=k)
            else:
                self.optimizer.step()
            self.version += 1

    def pull(self, k: int) -> None:
        """Worker ``k`` takes the newest parameters (their lookahead under a lookahead optimizer)."""
        self.base_version[k] = self.version
        if self.other is not None or isinstance(self.optimizer, LookaheadMomentum):
            pulled = self.other.pull_view(k) if self.other is not None else self.optimizer.lookahead()
            with torch.no_grad():
                for rp, v in zip(self.replicas[k].parameters(), pulled):
                    rp.copy_(v)
        else:
            self.replicas[k].load_state_dict(self.model.state_dict())

    def run(self) -> dict:
        """Every worker's pushes in the order of the virtual clock, then the model evaluated."""
        streams = [self.batches_of(k) for k in range(self.n)]
        for replica in self.replicas:
            replica.load_state_dict(self.model.state_dict())
        events = [(self.duration(k) + 1e-3 * k, k) for k in range(self.n)]
        heapq.heapify(events)
        while events:
            now, k = heapq.heappop(events)
            indices = next(streams[k], None)
            if indices is None:
                continue  # this worker is done
            tau = self.version - self.base_version[k]
            if indices:
                self.apply(k, self.gradients(k, indices), tau)
                self.pushes_done[k] += 1
            self.pull(k)
            heapq.heappush(events, (now + self.duration(k), k))
        loss, accuracy = evaluate(self.model, self.test, batch_size=self.config.training.eval_batch_size)
        losses = self.losses
        return {
            "accuracy": accuracy,
            "loss": loss,
            "versions": self.version,
            "rejected": self.rejected,
            "staleness": dict(sorted(self.histogram.items())),
            "loss_trace": [
                round(sum(losses[i : i + 16]) / len(losses[i : i + 16]), 3) for i in range(0, len(losses), 16)
            ],
        }


def simulate(
    config: Config,
    *,
    schedule: str = "uniform",
    jitter: float = 0.2,
    slowdown: float = 1.0,
    sim_seed: int = 0,
    variant: dict | None = None,
) -> dict:
    """One simulated async run of ``config``; returns final accuracy, loss and the staleness histogram."""
    simulation = AsyncSimulation(
        config, schedule=schedule, jitter=jitter, slowdown=slowdown, sim_seed=sim_seed, variant=variant
    )
    return simulation.run()


def simulation_config(
    *,
    workers: int,
    dataset: str,
    epochs: int,
    lr: float,
    momentum: float,
    optimizer: str,
    weight_decay: float,
    compression: str | None,
    ratio: float,
    staleness_policy: str,
    beta: float,
    max_staleness: int,
    correction: str,
    system: dict,
    seed: int = 0,
) -> Config:
    """The async run the simulation explores: ``system`` (extra system fields) overrides the named ones."""
    system_fields = {
        "num_workers": workers,
        "aggregation_mode": "async",
        "staleness_policy": staleness_policy,
        "async_correction": correction,
        "staleness_beta": beta,
        "max_staleness": max_staleness,
        **system,
    }
    if compression:
        system_fields.update(compression_enabled=True, compression_type=compression, compression_ratio=ratio)
    training = {
        "dataset": dataset,
        "num_epochs": epochs,
        "momentum": momentum,
        "learning_rate": lr,
        "optimizer": optimizer,
        "seed": seed,
        "device": "cpu",
        "weight_decay": weight_decay,
    }
    return validate_config({"training": training, "system": system_fields})


def simulate_repeats(
    config: Config,
    *,
    repeats: int,
    schedule: str = "uniform",
    jitter: float = 0.2,
    slowdown: float = 1.0,
    variant: dict | None = None,
    progress: TextIO | None = None,
) -> dict:
    """``repeats`` simulations of ``config``, the schedule seeded 0, 1, ...: their mean, min and max accuracy.

    Each run's result (with its ``seconds``) is written to ``progress`` as one JSON line as it finishes,
    since a run takes minutes.
    """
    accuracies = []
    for sim_seed in range(repeats):
        started = time.perf_counter()
        result = simulate(
            config, schedule=schedule, jitter=jitter, slowdown=slowdown, sim_seed=sim_seed, variant=variant
        )
        result["seconds"] = round(time.perf_counter() - started, 1)
        accuracies.append(result["accuracy"])
        if progress is not None:
            print(json.dumps(result), file=progress, flush=True)
    return {"mean": statistics.mean(accuracies), "min": min(accuracies), "max": max(accuracies)}
