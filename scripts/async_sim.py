"""In-process simulation of asynchronous parameter-server training, for exploring corrections fast.

N virtual workers each hold a snapshot of the parameters taken at their last pull; a virtual clock
decides who pushes next (each worker's compute time is ``slowdown_k * (1 + jitter * U)``, or
exponential). A push is the gradient of the worker's next batch of its shard (same shards, same
compression policy and error feedback as :mod:`src.worker`) at its snapshot; the server applies it
with the server-side optimizer, then the worker pulls the newest parameters. Staleness is counted
exactly as the server counts it (``version - base_version``).

This served the search: it runs one process at 1 thread, with a schedule under control (``uniform``
is a harsh round robin, ``exponential`` memoryless staleness, ``--slowdown`` a slow worker); every
claim in docs/async.md is confirmed with real runs (scripts/async_study.py). Prints each run's JSON
(accuracy, staleness histogram, train-loss trace per 16 pushes) on stderr and the summary on stdout.

    python scripts/async_sim.py --workers 2 --correction none --compression topk --repeats 3
    python scripts/async_sim.py --workers 4 --correction lookahead --compression topk --schedule exponential
    python scripts/async_sim.py --workers 4 --variant '{"lr_scale": 0.25, "own": false}'
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time

import torch

from src.compression import decompress
from src.compression_policy import policy_from_config
from src.config import validate_config
from src.data import load_dataset, make_shards, steps_per_epoch
from src.error_feedback import ErrorFeedback
from src.staleness import LookaheadMomentum, StalenessPolicy, compensated_momentum
from src.trainer import evaluate, forward_backward, model_from_config, optimizer_from_config


# ---- design-space variants measured in docs/async.md (the one chosen is src.staleness.LookaheadMomentum)
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


def server_optimizer(config, params):
    """The optimizer the parameter server uses for an async run of ``config`` (as ParameterServer._make_optimizer)."""
    t, system = config.training, config.system
    if system.async_correction == "lookahead" and t.optimizer == "sgd":
        return LookaheadMomentum.from_config(config, params)
    if system.async_correction == "implicit_momentum":
        momentum = compensated_momentum(t.momentum, system.num_workers)
        config = config.model_copy(update={"training": t.model_copy(update={"momentum": momentum})})
    return optimizer_from_config(config, params)


def simulate(
    config,
    *,
    schedule: str = "uniform",
    jitter: float = 0.2,
    slowdown: float = 1.0,
    sim_seed: int = 0,
    variant: dict | None = None,
) -> dict:
    """One simulated async run of ``config``; returns final accuracy, loss and the staleness histogram."""
    t, system = config.training, config.system
    n = system.num_workers
    train = load_dataset(t.dataset, "train", data_dir=t.data_dir, max_samples=t.max_train_samples, seed=t.seed)
    test = load_dataset(t.dataset, "test", data_dir=t.data_dir, max_samples=t.max_test_samples, seed=t.seed)
    model = model_from_config(config)
    optimizer = server_optimizer(config, model.parameters())
    other = None  # a design-space variant instead of the server's optimizer
    if variant is not None:
        other = MomentumVariant(
            model.parameters(),
            num_workers=n,
            lr=t.learning_rate * variant.get("lr_scale", 1.0),
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            lookahead=variant.get("lookahead", True),
            per_worker=variant.get("per_worker", True),
            own=variant.get("own", True),
        )
    losses = []
    staleness_policy = StalenessPolicy.from_config(system)
    replicas = [model_from_config(config) for _ in range(n)]
    params = list(model.parameters())
    names = [name for name, _ in model.named_parameters()]
    policy = policy_from_config(system)
    feedback = [ErrorFeedback() for _ in range(n)] if policy is not None and system.error_feedback else None
    generators = [torch.Generator().manual_seed(t.seed * 1_000_003 + k) for k in range(n)]
    rng = random.Random(sim_seed)
    steps = steps_per_epoch(len(train), n, t.batch_size)

    def batches_of(k):
        for epoch in range(t.num_epochs):
            shard = list(make_shards(len(train), n, epoch, t.seed)[k].batches(t.batch_size))
            for step in range(steps):
                yield shard[step] if step < len(shard) else []

    def duration(k):
        speed = slowdown if k == 0 else 1.0
        if schedule == "exponential":
            return speed * rng.expovariate(1.0)
        return speed * (1.0 + jitter * rng.random())

    streams = [batches_of(k) for k in range(n)]
    base_version = [0] * n
    pushes_done = [0] * n
    for replica in replicas:
        replica.load_state_dict(model.state_dict())
    events = [(duration(k) + 1e-3 * k, k) for k in range(n)]
    heapq.heapify(events)
    version, histogram, rejected = 0, {}, 0
    while events:
        now, k = heapq.heappop(events)
        indices = next(streams[k], None)
        if indices is None:
            continue  # this worker is done
        tau = version - base_version[k]
        if indices:
            replica = replicas[k]
            replica.zero_grad(set_to_none=True)
            images, labels = train.batch(indices)
            losses.append(forward_backward(replica, images, labels)[0])
            gradients = []
            for name, p in zip(names, replica.parameters()):
                g = p.grad
                if policy is not None:
                    compensated = feedback[k].compensate(name, g) if feedback else g
                    payload = policy.compress(compensated, pushes_done[k], generators[k])
                    if feedback:
                        feedback[k].update(name, compensated, payload)
                    g = decompress(payload)
                gradients.append(g)
            histogram[tau] = histogram.get(tau, 0) + 1
            weight, _reason = staleness_policy.verdict(tau)
            if weight is None:
                rejected += 1
                if feedback:
                    for name in names:
                        feedback[k].rollback(name)
            elif other is not None:
                other.step(k, gradients, weight)
                version += 1
            else:
                for p, g in zip(params, gradients):
                    p.grad = g * weight if weight != 1.0 else g
                if isinstance(optimizer, LookaheadMomentum):
                    optimizer.step(worker=k)
                else:
                    optimizer.step()
                version += 1
            pushes_done[k] += 1
        base_version[k] = version
        if other is not None or isinstance(optimizer, LookaheadMomentum):
            pulled = other.pull_view(k) if other is not None else optimizer.lookahead()
            with torch.no_grad():
                for rp, v in zip(replicas[k].parameters(), pulled):
                    rp.copy_(v)
        else:
            replicas[k].load_state_dict(model.state_dict())
        heapq.heappush(events, (now + duration(k), k))
    loss, accuracy = evaluate(model, test, batch_size=t.eval_batch_size)
    return {
        "accuracy": accuracy,
        "loss": loss,
        "versions": version,
        "rejected": rejected,
        "staleness": dict(sorted(histogram.items())),
        "loss_trace": [round(sum(losses[i : i + 16]) / len(losses[i : i + 16]), 3) for i in range(0, len(losses), 16)],
    }


def build_config(args, seed: int):
    system = {
        "num_workers": args.workers,
        "aggregation_mode": "async",
        "staleness_policy": args.staleness_policy,
        "async_correction": args.correction,
        "staleness_beta": args.beta,
        "max_staleness": args.max_staleness,
        **json.loads(args.system),
    }
    if args.compression:
        system.update(compression_enabled=True, compression_type=args.compression, compression_ratio=args.ratio)
    training = {
        "dataset": args.dataset,
        "num_epochs": args.epochs,
        "momentum": args.momentum,
        "learning_rate": args.lr,
        "optimizer": args.optimizer,
        "seed": seed,
        "device": "cpu",
        "weight_decay": args.weight_decay,
    }
    return validate_config({"training": training, "system": system})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dataset", default="mnist_5k")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--compression", choices=("topk", "quantization"))
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--staleness-policy", default="none")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--max-staleness", type=int, default=8)
    parser.add_argument("--system", default="{}", help="extra system fields as JSON (e.g. the correction)")
    parser.add_argument("--schedule", choices=("uniform", "exponential"), default="uniform")
    parser.add_argument("--jitter", type=float, default=0.2)
    parser.add_argument("--slowdown", type=float, default=1.0, help="worker 0 takes this many times longer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--correction",
        choices=("none", "implicit_momentum", "lookahead"),
        default="lookahead",
        help="system.async_correction",
    )
    parser.add_argument("--variant", default="", help="JSON: a MomentumVariant instead of the server's optimizer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for r in range(args.repeats):
        started = time.perf_counter()
        result = simulate(
            build_config(args, seed=0),
            schedule=args.schedule,
            jitter=args.jitter,
            slowdown=args.slowdown,
            sim_seed=r,
            variant=json.loads(args.variant) if args.variant else None,
        )
        result["seconds"] = round(time.perf_counter() - started, 1)
        results.append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    accuracies = [r["accuracy"] for r in results]
    print(
        json.dumps(
            {"args": vars(args), "mean": statistics.mean(accuracies), "min": min(accuracies), "max": max(accuracies)}
        )
    )


if __name__ == "__main__":
    main()
