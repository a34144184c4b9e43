"""torch_asgc.ddp: our gradient exchange on your own ``DistributedDataParallel`` model, in one call.

The same hooks the DDP runner uses (:mod:`src.ddp.comm_hooks`), for any model and any training loop::

    model = DistributedDataParallel(net)
    hook = torch_asgc.ddp.register_compression_hook(model, "topk", ratio=0.01, value_dtype="bfloat16",
                                                    warmup_steps=10)
    ...                                        # your loop: forward, backward, optimizer.step()
    hook.stats.bytes_sent                      # counted from the payloads this rank sent
    hook.set_topk_ratio(0.05)                  # on every rank, between the same two steps
    torch.save({"model": net.state_dict(), "hook": hook.state_dict()}, f"ckpt_rank{rank}.pt")
    hook.load_state_dict(torch.load(f"ckpt_rank{rank}.pt", weights_only=True)["hook"])  # resume
    hook.close()                               # after the last step

What the compression hook does with each of DDP's gradient buckets: error feedback adds back what
earlier steps left out (per parameter), the bucket is compressed as one flat tensor (top-k, or
stochastic quantization), every rank's payload is exchanged with one ``all_gather``, and each rank
decompresses and averages them in rank order, so every replica gets bit-identical gradients. The
exchange runs on a background thread while the backward pass goes on. The first ``warmup_steps``
steps use a plain allreduce. Buckets too small to gain are sent uncompressed.

How to tune it: ``ratio`` (top-k's kept fraction; a kept entry costs 8 bytes with float32 values,
6 with ``value_dtype="bfloat16"`` or ``"float16"``, against 4 per dense entry), ``bits`` and
``bucket_size`` (quantization), ``warmup_steps``, ``error_feedback`` (leave it on for top-k).
``register_ring_hook`` swaps DDP's built-in allreduce for our explicit, pipelined ring, whose bytes
are counted from what it sends.

Mixed precision: use ``torch.autocast(dtype=torch.bfloat16)`` without a GradScaler. A GradScaler
(float16) would scale the gradients the residuals are kept in by a factor that changes during the
run, and its overflow steps hand the compressor infinite values, which it refuses.

The state (``hook.state_dict()``) holds this rank's residuals, the step counter and the compression
units, as CPU tensors and plain values (loadable with ``torch.load(..., weights_only=True)``). Save
it per rank and load it on the same rank, with the same hook and world size: a resumed run then
compresses exactly what the uninterrupted one would have.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from src.compression import Compressor, build_compressor
from src.compressors.policy import CompressionPolicy
from src.ddp.comm_hooks import CommHook, compression_comm_hook, ring_comm_hook
from src.ddp.comm_stats import CommStats
from src.ddp.ring_allreduce import PLAIN_ALLREDUCE

__all__ = ["CommHook", "CommStats", "register_compression_hook", "register_ring_hook"]


def _wrapped(model: Any, caller: str):
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"{caller}: model must be a torch.nn.parallel.DistributedDataParallel, got {type(model).__name__}"
        )
    return model.module


def register_compression_hook(
    model: DistributedDataParallel,
    compressor: str | Compressor = "topk",
    *,
    error_feedback: bool = True,
    warmup_steps: int = 0,
    warmup_allreduce: str = "default",
    group=None,
    seed: int = 0,
    overlap: bool = True,
    **options: Any,
) -> CommHook:
    """Compress ``model``'s gradient exchange; returns the registered hook (stats, state, ratio setter).

    Args:
        model: your ``DistributedDataParallel`` model, before its first backward pass.
        compressor: ``"topk"`` or ``"quantization"`` (configured by ``options``), or a compressor
            from :func:`torch_asgc.build_compressor`.
        error_feedback: carry what compression left out into the next step (per parameter).
        warmup_steps: steps exchanged with a plain allreduce before compression starts.
        warmup_allreduce: that allreduce: ``"default"`` (the backend's) or ``"ring"`` (ours).
        group: process group (default: the world).
        seed: base seed of quantization's random rounding (each step, rank and bucket draws its own).
        overlap: exchange on a background thread while backward goes on (default), or inline.
        **options: the compressor's settings: top-k ``ratio`` (default 0.01), ``value_dtype``
            (``"float32"``, ``"bfloat16"``, ``"float16"``), ``selection``; quantization ``bits``
            (8, 4, 2), ``bucket_size``.

    Returns:
        The :class:`CommHook`: ``stats`` (bytes sent and received, counted from the payloads),
        ``set_topk_ratio(rho)`` / ``topk_ratio``, ``state_dict()`` / ``load_state_dict()``, ``close()``.

    Raises:
        TypeError: ``model`` is not a ``DistributedDataParallel``.
        ValueError: an unknown compressor or option, or a bad value (the message names it).
    """
    module = _wrapped(model, "register_compression_hook")
    if warmup_allreduce not in PLAIN_ALLREDUCE:
        raise ValueError(
            f"register_compression_hook: warmup_allreduce must be one of {sorted(PLAIN_ALLREDUCE)}, "
            f"got {warmup_allreduce!r}"
        )
    if isinstance(compressor, Compressor):
        if options:
            raise ValueError(
                f"register_compression_hook: options {sorted(options)} given with a ready-made compressor; "
                f"build it with them instead"
            )
        built = compressor
    else:
        built = build_compressor(compressor, **options)
    policy = CompressionPolicy(built, warmup_steps=warmup_steps)
    hook = compression_comm_hook(
        policy,
        module,
        error_feedback=error_feedback,
        plain_allreduce=warmup_allreduce,
        group=group,
        seed=seed,
        overlap=overlap,
    )
    hook.register(model)
    return hook


def register_ring_hook(model: DistributedDataParallel, *, group=None, overlap: bool = True) -> CommHook:
    """Exchange ``model``'s gradients with our explicit, pipelined ring all-reduce; returns the hook.

    Same result as DDP's built-in allreduce (up to the order of floating-point additions), with each
    rank's bytes counted from the segments it sends (``hook.stats``). Nothing to checkpoint.

    Raises:
        TypeError: ``model`` is not a ``DistributedDataParallel``.
    """
    hook = ring_comm_hook(_wrapped(model, "register_ring_hook"), group=group, overlap=overlap)
    hook.register(model)
    return hook
