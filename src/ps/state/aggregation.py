"""The parameter server's aggregation state machine: versions, the sync barrier, async apply, de-dup.

No gRPC and no threads here (the server calls it with its lock held), so it is tested directly.

* :class:`ModelState`: the served model's parameters and floating-point buffers, the server-side
  optimizer, and the **Server Version** (optimizer steps taken). :meth:`ModelState.step` applies one
  gradient (read, never written: it may be a read-only view of the received message).
* :class:`SyncRound`: one barrier. It knows which workers were handed work for this version; when
  every one of them has pushed (or left: a failed worker is dropped with its contribution), the
  contributions are averaged weighted by sample count, ``sum n_k g_k / sum n_k`` (exactly the
  large-batch gradient, also for short or uneven batches), in worker-id order so sums reproduce.
* :class:`RequestLog`: every push carries a request id; a retry of a push that was handled gets the
  first reply again and is not applied twice, and a worker that registers again can ask whether its
  last push was applied. Only each worker's newest reply is kept. The log is part of the server's checkpoint.

**Async apply** is one :meth:`ModelState.step` with the staleness policy's weight; the server does it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from src.ps.state.staleness import LookaheadMomentum
from src.training.optimizers import apply_gradients

REMEMBERED_REQUESTS = 64
"""Request outcomes (applied or not) remembered per worker: far more than one worker can have in flight."""


@dataclass
class Contribution:
    """One decoded, validated push: its gradients (one per parameter) and buffer values."""

    worker: int
    num_samples: int
    gradients: list[torch.Tensor]
    buffers: list[torch.Tensor] = field(default_factory=list)
    request_id: int = 0
    learning_rate: float | None = None
    """The rate the worker's own scheduler set for this step (``None``: none; the server's schedule applies)."""
    payload_bytes: int = 0
    """Bytes of the push's gradient payloads as they travelled (what the adaptive controller's link model reads)."""


def weighted_mean(
    gradients: Sequence[Sequence[torch.Tensor]], samples: Sequence[int], out: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The sample-weighted mean of two or more pushes' gradients (``gradients[k]``: push ``k``'s, one tensor per
    parameter; ``samples[k]``: its samples), written into ``out`` (one tensor per parameter) and returned.

    (g1 + n2/n1 g2 + ...) * n1/N: one pass per push after the first, then the scaling; against copy, scale, add and
    divide, 0.93 ms instead of 1.5 for two simple_cnn pushes here. Pushes of equal sample counts give
    (g1 + g2) * 0.5, bit for bit DDP's (g1 + g2) / 2. Elementwise: a slice of every tensor gives that slice of the
    mean (:mod:`src.ps.state.slice_pipeline` relies on it).
    """
    first, second, *rest = gradients
    n1 = samples[0]
    for target, start, other in zip(out, first, second):
        torch.add(start, other, alpha=samples[1] / n1, out=target)
    for more, count in zip(rest, samples[2:]):
        torch._foreach_add_(out, list(more), alpha=count / n1)
    torch._foreach_mul_(out, n1 / sum(samples))
    return out


class ModelState:
    """Parameters, buffers, optimizer and version of the served model.

    With a :class:`~src.ps.state.staleness.LookaheadMomentum` optimizer (async correction), workers are sent
    its lookahead point rather than the parameters (:meth:`sent`); evaluation and checkpoints use
    the parameters.

    Args:
        model: the model (CPU, float32, contiguous parameters).
        optimizer: the server-side optimizer over ``model``'s trainable parameters.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        named_buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        self.param_names = [n for n, _ in named_params]
        self.buffer_names = [n for n, _ in named_buffers]
        self.params = [p for _, p in named_params]
        self.buffers = [b for _, b in named_buffers]
        self.dense_bytes = 4 * sum(p.numel() for p in self.params)
        """Bytes of one uncompressed gradient of every trainable parameter (float32; the parameters are fixed)."""
        self.version = 0
        self._sums: list[torch.Tensor] | None = None  # reused from barrier to barrier
        self.lookahead = optimizer if isinstance(optimizer, LookaheadMomentum) else None
        self._sent = [torch.empty_like(p) for p in self.params] if self.lookahead else self.params
        self._revision = 0  # changes whenever what is sent changes
        self._sent_revision = -1
        self.before_change: Callable[[], None] | None = None
        """Called before the sent tensors or buffers change in place (a transport sending from them copies them)."""
        self.forgotten: list[int] = []
        """Workers whose momentum :meth:`forget_worker` dropped since the last step (a sharded async server's
        followers drop it at the same point: :mod:`src.ps.shards.asynchronous`)."""

    def sent(self) -> list[torch.Tensor]:
        """What workers are sent: the parameters, or the lookahead point (updated once per change).

        The same tensor objects every time, so byte views of them stay valid.
        """
        if self.lookahead is not None and self._sent_revision != self._revision:
            self.lookahead.lookahead(out=self._sent)
            self._sent_revision = self._revision
        return self._sent

    @property
    def learning_rate(self) -> float:
        """The rate the optimizer's next step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_learning_rate(self, lr: float) -> None:
        """The rate of the optimizer's next step (every parameter group; the lookahead point moves with it)."""
        if lr != self.learning_rate:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self._revision += 1

    def forget_worker(self, worker: int) -> None:
        """``worker`` left (finished or failed): its pending momentum no longer counts in the lookahead."""
        if self.lookahead is not None:
            if self.before_change is not None:
                self.before_change()  # the lookahead point, which workers are sent, moves
            self.lookahead.forget_worker(worker)
            self.forgotten.append(worker)
            self._revision += 1

    def step(
        self, gradients: list[torch.Tensor], buffers: list[torch.Tensor], weight: float = 1.0, *, worker: int = 0
    ) -> None:
        """One optimizer step with ``weight * gradients`` (``worker``'s push) and the new buffer values; version + 1."""
        if self.before_change is not None:
            self.before_change()
        if weight != 1.0:  # out of place: the gradients may be read-only views of a message
            gradients = [g * weight for g in gradients]
        if self.lookahead is not None:
            for param, gradient in zip(self.params, gradients):
                param.grad = gradient.to(param.device)
            self.lookahead.step(worker=worker)
            for param in self.params:
                param.grad = None  # do not keep the push's message alive until the next step
        else:
            apply_gradients(self.optimizer, self.params, gradients)  # torch's SGD update, without step()'s wrapper
        with torch.no_grad():
            for buffer, value in zip(self.buffers, buffers):
                buffer.copy_(value)
        self.version += 1
        self._revision += 1
        self.forgotten.clear()

    def pass_version(self) -> None:
        """Version + 1 with nothing changed: an async push applied on other shards and rolled back on this one (its
        staleness here was over the bound; :mod:`src.ps.shards.asynchronous`)."""
        self.version += 1
        self.forgotten.clear()

    def average(self, contributions: list[Contribution]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Sample-weighted mean of the gradients and buffers of ``contributions`` (none may be empty)."""
        if len(contributions) == 1:  # the weighted average of one gradient is that gradient
            gradients = contributions[0].gradients
        else:
            if self._sums is None:
                self._sums = [torch.empty_like(p, dtype=torch.float32) for p in self.params]
            gradients = weighted_mean(
                [c.gradients for c in contributions], [c.num_samples for c in contributions], self._sums
            )
        with_buffers = [c for c in contributions if c.buffers]
        if len(with_buffers) <= 1:
            buffers = with_buffers[0].buffers if with_buffers else []
        else:
            weight = sum(c.num_samples for c in with_buffers)
            buffers = [
                sum(c.buffers[i] * (c.num_samples / weight) for c in with_buffers) for i in range(len(self.buffers))
            ]
        return gradients, buffers

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the model's state dict (for checkpoints and background evaluation)."""
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}


class SyncRound:
    """The barrier of one sync version: who must push, and what has arrived."""

    def __init__(self, version: int, expected: set[int]):
        self.version = version
        self.expected = set(expected)
        self.arrived: dict[int, Contribution] = {}

    def add(self, contribution: Contribution) -> None:
        """Record a push of an expected worker that has not pushed yet.

        Raises:
            ValueError: the worker is not in this round, or already pushed.
        """
        worker = contribution.worker
        if worker not in self.expected:
            raise ValueError(f"worker {worker} has no work in the round of version {self.version}")
        if worker in self.arrived:
            raise ValueError(f"worker {worker} already pushed for version {self.version}")
        self.arrived[worker] = contribution

    def drop(self, worker: int) -> bool:
        """A worker left (failed): forget it and its contribution; returns whether it was in the round."""
        was_in = worker in self.expected
        self.expected.discard(worker)
        self.arrived.pop(worker, None)
        return was_in

    def complete(self) -> bool:
        """Every expected worker has pushed (and at least one did)."""
        return bool(self.arrived) and self.expected == set(self.arrived)

    def contributions(self) -> list[Contribution]:
        """The pushes in worker-id order (a fixed order makes the sum reproducible)."""
        return [self.arrived[w] for w in sorted(self.arrived)]


class RequestLog:
    """Request ids per worker: in progress, or handled with their reply (and whether they were applied).

    Only a worker's newest handled reply is kept: a worker has one push in flight at a time, so a retry
    is of its newest push. An older request id it sends again is :attr:`SUPERSEDED` (known from its
    outcome), never applied a second time. What a "reply" is, is the server's business (the server
    keeps the verdict of a dense reply and rebuilds the parameters, not ~45 MB of a resnet18's bytes).
    """

    IN_PROGRESS = object()
    SUPERSEDED = object()

    def __init__(self) -> None:
        self._entries: dict[int, dict[int, Any]] = {}
        self._applied: dict[int, OrderedDict[int, bool]] = {}

    def lookup(self, worker: int, request_id: int) -> Any:
        """The stored reply, :attr:`IN_PROGRESS`, :attr:`SUPERSEDED`, or ``None`` for a request never seen."""
        found = self._entries.get(worker, {}).get(request_id)
        if found is None and request_id in self._applied.get(worker, {}):
            return self.SUPERSEDED
        return found

    def begin(self, worker: int, request_id: int) -> None:
        self._entries.setdefault(worker, {})[request_id] = self.IN_PROGRESS

    def abandon(self, worker: int, request_id: int) -> None:
        """The request was refused or its worker failed before a reply: a retry is handled afresh."""
        self._entries.get(worker, {}).pop(request_id, None)

    def finish(self, worker: int, request_id: int, reply: Any, applied: bool) -> None:
        entries = self._entries.setdefault(worker, {})
        for older in [rid for rid, value in entries.items() if value is not self.IN_PROGRESS and rid != request_id]:
            del entries[older]  # its outcome stays in _applied
        entries[request_id] = reply
        self.mark(worker, request_id, applied)

    def mark(self, worker: int, request_id: int, applied: bool) -> None:
        """Record whether ``request_id`` ended up in an applied update."""
        outcomes = self._applied.setdefault(worker, OrderedDict())
        outcomes[request_id] = applied
        while len(outcomes) > REMEMBERED_REQUESTS:
            outcomes.popitem(last=False)

    def was_applied(self, worker: int, request_id: int) -> bool:
        """Whether ``request_id`` of ``worker`` is known to have been applied."""
        return bool(self._applied.get(worker, {}).get(request_id, False))

    def state_dict(self) -> dict[str, Any]:
        """The applied/not-applied outcomes (replies are not kept: a resumed server answers afresh)."""
        return {str(w): [[rid, applied] for rid, applied in outcomes.items()] for w, outcomes in self._applied.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._entries = {}
        self._applied = {int(w): OrderedDict((int(rid), bool(a)) for rid, a in pairs) for w, pairs in state.items()}
