"""DDP communication hooks: an explicit ring all-reduce, and compressed gradient exchange.

(No ``from __future__ import annotations`` here: DDP checks a hook's annotations against the real
``dist.GradBucket`` / ``Future[Tensor]`` objects, and postponed annotations would be strings.)

DistributedDataParallel hands each gradient bucket (a flat tensor holding several parameters'
gradients, in the order the backward pass produces them) to a hook
``hook(state, bucket) -> torch.futures.Future[Tensor]`` whose result replaces the bucket with the
average over ranks. This module provides two hooks and :class:`CommHook`, a hook with its state
ready to register; :func:`comm_hook_from_config` picks one from ``system``:

* no hook (``system.allreduce: default``, no compression): DDP's built-in allreduce in C++, the
  fastest path. Its bytes cannot be seen, so :class:`~src.ddp.comm_stats.CommStats` records the
  ring-equivalent estimate ``2(N-1)/N`` x gradient bytes under ``estimated_bytes_*``.
* :func:`ring_allreduce_hook` (``system.allreduce: ring``): :func:`src.ddp.ring_allreduce.ring_allreduce_`,
  a reduce-scatter then an all-gather over point-to-point ``isend``/``irecv`` between ring
  neighbours, pipelined. Each rank sends ``2(N-1)/N`` of the bucket, counted from the tensors it sends.
* :func:`compression_hook` (``system.compression_enabled``): the bucket's gradients are compensated
  by error feedback, compressed by :mod:`src.compression` and exchanged with one ``all_gather``
  (:mod:`src.ddp.compressed_exchange`), in compression units that survive DDP's re-bucketing and a
  resume (:mod:`src.ddp.hook_state`). Bytes are counted from the payloads.

Both hooks return their future without blocking: the exchange runs on one background thread per
hook (:mod:`src.ddp.exchange_thread`; buckets in DDP's order, which is the same on every rank, so
collectives match), while the backward pass goes on producing the next buckets; DDP waits for the
futures before the optimizer step. ``overlap=False`` runs the same work inline (the tests check both
give identical gradients). Each bucket's exchange is a ``hook_exchange`` span (:mod:`src.telemetry.tracing`)
on the thread that runs it; how long the backward pass waited for them is measured by
:mod:`src.telemetry.exposed_comm`. :meth:`CommHook.settle_buckets` runs one silent backward pass before
training, so DDP rebuilds its buckets before the first real step.

How to tune it: ``system.compression_ratio`` (top-k fraction of each segment; 8 bytes per kept
entry against 4 per dense entry, so ratio r sends about 2r of the dense bytes; 6 bytes, 1.5r, with
``system.compression_value_dtype`` bfloat16 or float16),
``quantization_bits``, ``warmup_steps`` (plain allreduce, ``default`` or ``ring``, for the first
steps: early gradients are the most sensitive to compression), ``error_feedback`` (leave it on for
top-k). :data:`src.ddp.ring_allreduce.RING_SEGMENT_BYTES` sets the ring's pipelining grain. With
``system.adaptive_compression`` the top-k ratio changes during the run
(:meth:`CommHook.set_topk_ratio`, on every rank at the same step: see :mod:`src.ddp.control`).
"""

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from src.compression import TopKCompressor
from src.compressors.policy import CompressionPolicy, policy_from_config
from src.config import SystemConfig
from src.ddp.comm_stats import CommStats, gradient_bytes, ring_allreduce_bytes
from src.ddp.compressed_exchange import compressed_average_
from src.ddp.exchange_thread import ExchangeThread, completed_future, run_exchange, timed
from src.ddp.hook_state import CompressionHookState, bucket_pieces
from src.ddp.ring_allreduce import PLAIN_ALLREDUCE, ring_allreduce_
from src.telemetry import tracing


@dataclass
class RingHookState:
    """State of :func:`ring_allreduce_hook`: the group, steps taken, bytes counted (nothing to checkpoint).

    ``overlap``: run each bucket's ring on the exchange thread and return at once (default), or
    inline.
    """

    group: Any = None
    step: int = 0
    stats: CommStats = field(default_factory=CommStats)
    overlap: bool = True
    thread: ExchangeThread = field(default_factory=ExchangeThread)

    def close(self) -> None:
        self.thread.close()


def ring_allreduce_hook(state: RingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: average the bucket with :func:`ring_allreduce_`, off the backward pass."""
    buffer = bucket.buffer()
    step, index = state.step, bucket.index()
    if bucket.is_last():
        state.step += 1

    def exchange() -> torch.Tensor:
        with timed(state.stats), tracing.span("hook_exchange", step=step, bucket=index):
            state.stats.measured(*ring_allreduce_(buffer, state.group))
            return buffer.div_(dist.get_world_size(state.group))

    return run_exchange(state, exchange)


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: compress the bucket segment by segment, ``all_gather`` the payloads, average.

    Returns at once (the exchange runs on the state's thread) unless ``state.overlap`` is off.
    """
    buffer = bucket.buffer()
    if state.probing:
        if bucket.is_last():
            state.passes += 1
        return completed_future(buffer)
    segments = state.segments_for(bucket_pieces(state, bucket))
    step, index = state.step, bucket.index()
    if bucket.is_last():
        state.step += 1
        state.passes += 1

    def exchange() -> torch.Tensor:
        with timed(state.stats), tracing.span("hook_exchange", step=step, bucket=index):
            world = dist.get_world_size(state.group)
            if step < state.policy.warmup_steps:
                PLAIN_ALLREDUCE[state.plain_allreduce](buffer, state.group, state.stats)
                state.stats.compressed(4 * buffer.numel(), 4 * buffer.numel())
                return buffer.div_(world)
            return compressed_average_(state, buffer, segments, step, world)

    return run_exchange(state, exchange)


@dataclass
class CommHook:
    """A hook and its state, ready to register on a DDP model, plus how to account its bytes.

    ``hook is None`` means DDP's built-in allreduce; :meth:`end_step` then adds the ring-equivalent
    estimate of the step's gradient bytes to ``stats``.
    """

    name: str
    state: Any = None
    hook: Callable | None = None
    stats: CommStats = field(default_factory=CommStats)
    world_size: int = 1
    gradient_bytes: int = 0

    def register(self, model: nn.parallel.DistributedDataParallel) -> None:
        if self.hook is not None:
            model.register_comm_hook(self.state, self.hook)

    def settle_buckets(self, model: nn.parallel.DistributedDataParallel, sample: torch.Tensor) -> None:
        """Let DDP rebuild its buckets before training, so every step compresses the same units.

        One forward and backward pass of ``sample`` in eval mode (no running statistics move),
        with the hook handing buckets back untouched: no communication, no step counted. The
        gradients it leaves are zeroed. Only hooks whose units follow the bucket layout need it.
        """
        if not hasattr(self.state, "probing"):
            return
        was_training = model.training
        model.eval()
        self.state.probing = True
        try:
            model(sample).float().sum().mul(0.0).backward()
        finally:
            self.state.probing = False
            model.train(was_training)
        model.zero_grad(set_to_none=True)

    def end_step(self) -> None:
        """Account one optimizer step of the built-in allreduce (hooks count their own bytes)."""
        if self.hook is None:
            nbytes = ring_allreduce_bytes(self.world_size, self.gradient_bytes)
            self.stats.estimated(nbytes, nbytes)

    def state_dict(self) -> dict[str, Any]:
        """The hook's resumable state (empty for the built-in allreduce)."""
        saver = getattr(self.state, "state_dict", None)
        return saver() if callable(saver) else {}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on the same rank of a run with the same hook."""
        loader = getattr(self.state, "load_state_dict", None)
        if callable(loader):
            loader(saved)

    @property
    def topk_ratio(self) -> float | None:
        """The top-k Active Fraction this hook compresses with (``None``: it does not compress with top-k)."""
        compressor = getattr(getattr(self.state, "policy", None), "compressor", None)
        return compressor.ratio if isinstance(compressor, TopKCompressor) else None

    def set_topk_ratio(self, ratio: float) -> None:
        """Compress with top-k ratio ``ratio`` from the next step on (the adaptive controller, :mod:`src.ddp.control`).

        Call it between steps, when no exchange is in flight, and on every rank for the same step:
        the payloads ``all_gather`` exchanges must be the same size on every rank.

        Raises:
            ValueError: the hook does not compress with top-k, or ``ratio`` is not in (0, 1].
        """
        if self.topk_ratio is None:
            raise ValueError(f"comm hook {self.name!r} does not compress with top-k: no ratio to set")
        policy = self.state.policy
        self.state.policy = replace(policy, compressor=replace(policy.compressor, ratio=ratio))

    def set_step(self, step: int) -> None:
        """Start counting steps at ``step`` (a resumed run whose checkpoint has no state for this hook)."""
        if hasattr(self.state, "step"):
            self.state.step = int(step)

    def close(self) -> None:
        """Stop the hook's exchange thread (after the last step)."""
        closer = getattr(self.state, "close", None)
        if callable(closer):
            closer()


def compression_comm_hook(
    policy: CompressionPolicy,
    model: nn.Module,
    *,
    error_feedback: bool = True,
    plain_allreduce: str = "default",
    group=None,
    seed: int = 0,
    overlap: bool = True,
) -> CommHook:
    """:func:`compression_hook` with ``policy`` for ``model`` (the module DDP wraps), not yet registered.

    Arguments as :class:`CompressionHookState`'s; the hook is named after the policy's compressor.
    """
    state = CompressionHookState(
        policy,
        param_names={id(p): name for name, p in model.named_parameters()},
        error_feedback=error_feedback,
        plain_allreduce=plain_allreduce,
        group=group,
        seed=seed,
        overlap=overlap,
    )
    return CommHook(
        policy.compressor.name,
        state,
        compression_hook,
        state.stats,
        world_size=dist.get_world_size(group),
        gradient_bytes=gradient_bytes(model),
    )


def ring_comm_hook(model: nn.Module, *, group=None, overlap: bool = True) -> CommHook:
    """:func:`ring_allreduce_hook` for ``model`` (the module DDP wraps), not yet registered."""
    state = RingHookState(group=group, overlap=overlap)
    return CommHook(
        "ring",
        state,
        ring_allreduce_hook,
        state.stats,
        world_size=dist.get_world_size(group),
        gradient_bytes=gradient_bytes(model),
    )


def comm_hook_from_config(
    system: SystemConfig, model: nn.Module, *, group=None, seed: int = 0, overlap: bool = True
) -> CommHook:
    """The gradient exchange ``system`` asks for, for ``model`` (the module DDP wraps).

    Compression takes precedence; its warm-up steps use ``system.allreduce``.

    Raises:
        ValueError: unknown compression type or allreduce name.
    """
    if system.compression_enabled:
        return compression_comm_hook(
            policy_from_config(system),
            model,
            error_feedback=system.error_feedback,
            plain_allreduce=system.allreduce,
            group=group,
            seed=seed,
            overlap=overlap,
        )
    if system.allreduce == "ring":
        return ring_comm_hook(model, group=group, overlap=overlap)
    if system.allreduce == "default":
        return CommHook("allreduce", world_size=dist.get_world_size(group), gradient_bytes=gradient_bytes(model))
    raise ValueError(f"system.allreduce: must be one of {sorted(PLAIN_ALLREDUCE)}, got {system.allreduce!r}")


__all__ = [
    "CommHook",
    "RingHookState",
    "comm_hook_from_config",
    "compression_comm_hook",
    "compression_hook",
    "ring_allreduce_hook",
    "ring_comm_hook",
]
