"""The compression hook's state: its compression units (segments), the residuals, the per-unit seeds, checkpoints.

DDP puts every parameter in one bucket for a process's first backward pass and re-buckets by
gradient-arrival order from the second one on, so a resumed process would see another layout at
the step it resumes from. The compression hook (:mod:`src.ddp.comm_hooks`) therefore compresses
*segments*: the buckets of the rebuilt layout, learned when DDP first shows them
(:meth:`CompressionHookState.segments_for`) and saved with the hook state. A bucket that holds
several known segments (the first pass's single bucket) is compressed segment by segment, each in
its own parameter order; so every step compresses the same units whatever the process's history,
and a resumed run reproduces the uninterrupted one exactly. Error feedback is kept per parameter
(the residuals of a segment are its parameters' residuals side by side), which is also what the
parameter-server worker keeps, so checkpoints read as ``{parameter name: tensor}`` whatever the
bucket layout. Each (step, rank, segment) draws stochastic compression from its own seed.
:func:`rebuilt_buckets` predicts the rebuilt layout without a process group (:mod:`src.virtual.ddp`).
"""

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from src.common.seeds import derive_seed
from src.compressors.error_feedback import ErrorFeedback
from src.compressors.policy import CompressionPolicy
from src.ddp.comm_stats import CommStats
from src.ddp.exchange_thread import ExchangeThread
from src.ddp.ring_allreduce import PLAIN_ALLREDUCE


@dataclass(frozen=True)
class Piece:
    """One parameter's gradient inside a bucket."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Segment:
    """One compression unit: parameters compressed together, in this order."""

    pieces: tuple[Piece, ...]
    start: int | None
    """Offset in the bucket when the pieces lie there side by side in this order (then the segment
    is a slice of the bucket: no copies); ``None`` otherwise."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(piece.name for piece in self.pieces)

    @property
    def numel(self) -> int:
        return sum(piece.numel for piece in self.pieces)


class CompressionHookState:
    """State of :func:`src.ddp.comm_hooks.compression_hook`: policy, segments, residuals per parameter, step, bytes.

    Args:
        policy: compressor + warm-up steps + small-tensor skip rule. During warm-up the bucket goes
            through ``plain_allreduce`` (no residuals are touched); afterwards each segment is
            sent with ``policy.compressor_for(step, numel)`` (identity for segments too small to gain).
        param_names: ``id(parameter) -> name`` for the wrapped module's parameters (residual keys).
        error_feedback: keep what compression dropped and add it to the next gradient.
        plain_allreduce: a key of :data:`src.ddp.ring_allreduce.PLAIN_ALLREDUCE` for uncompressed steps.
        group: process group (default: the world).
        seed: base seed of stochastic compressors; each (step, rank, segment) gets its own stream,
            so quantization noise is independent across ranks and a resumed run draws the same
            noise as an uninterrupted one.
        overlap: exchange on the background thread and return at once (default), or inline.
    """

    def __init__(
        self,
        policy: CompressionPolicy,
        *,
        param_names: Mapping[int, str],
        error_feedback: bool = True,
        plain_allreduce: str = "default",
        group=None,
        seed: int = 0,
        overlap: bool = True,
    ):
        if plain_allreduce not in PLAIN_ALLREDUCE:
            raise ValueError(f"system.allreduce: must be one of {sorted(PLAIN_ALLREDUCE)}, got {plain_allreduce!r}")
        self.policy = policy
        self.param_names = dict(param_names)
        self.param_index = {name: index for index, name in enumerate(sorted(self.param_names.values()))}
        self.error_feedback = ErrorFeedback() if error_feedback else None
        self.plain_allreduce = plain_allreduce
        self.group = group
        self.seed = seed
        self.overlap = overlap
        self.step = 0
        self.stats = CommStats()
        self.thread = ExchangeThread()
        self.segments: list[tuple[str, ...]] = []
        """The compression units: DDP's rebuilt buckets, as parameter names in bucket order."""
        self.passes = 0
        """Backward passes this process has seen (the first has DDP's provisional single bucket)."""
        self.probing = False
        """A silent pass (see :meth:`src.ddp.comm_hooks.CommHook.settle_buckets`): hand the bucket back untouched."""
        self._segments_of: dict[tuple[str, ...], list[Segment]] = {}

    def close(self) -> None:
        self.thread.close()

    # -- segments -------------------------------------------------------------------------

    def segments_for(self, pieces: Sequence[Piece]) -> list[Segment]:
        """The compression units of a bucket holding ``pieces`` (in bucket order); learns new ones.

        From a process's second pass on, DDP's buckets are final: a bucket that is not a known
        segment becomes one (replacing the known ones it overlaps). In the first pass, a bucket
        made of known segments (a resumed process) is split into them; otherwise it is one unit
        for that pass only.
        """
        names = tuple(piece.name for piece in pieces)
        final = self.passes >= 1
        cached = self._segments_of.get(names)
        if cached is not None:
            return cached
        by_name = {piece.name: piece for piece in pieces}
        if final and names not in self.segments:
            taken = set(names)
            self.segments = [segment for segment in self.segments if not taken & set(segment)] + [names]
            self._segments_of.clear()
        known = [segment for segment in self.segments if set(segment) <= set(names)]
        if sum(len(segment) for segment in known) == len(names):
            units = known
        else:
            units = [names]
        result = [self._segment([by_name[name] for name in unit]) for unit in units]
        if final or units is known:
            self._segments_of[names] = result
        return result

    @staticmethod
    def _segment(pieces: list[Piece]) -> Segment:
        side_by_side = all(b.offset == a.offset + a.numel for a, b in zip(pieces, pieces[1:]))
        return Segment(tuple(pieces), pieces[0].offset if side_by_side else None)

    def _seed(self, step: int, rank: int, segment: Segment) -> int:
        unit = self.param_index[segment.pieces[0].name]
        return derive_seed(self.seed, step, rank, unit)

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "segments", "error_feedback"}`` with CPU tensors; loadable with ``weights_only=True``."""
        saved = None
        if self.error_feedback is not None:
            saved = self.error_feedback.state_dict()
            for section in ("residuals", "pending"):
                saved[section] = {name: tensor.detach().cpu() for name, tensor in saved[section].items()}
        return {"step": self.step, "segments": [list(segment) for segment in self.segments], "error_feedback": saved}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: error-feedback state present on one side only, or residuals or segments
                for parameters this model does not have.
        """
        saved = state.get("error_feedback")
        if (saved is None) != (self.error_feedback is None):
            have = "with" if self.error_feedback is not None else "without"
            raise ValueError(
                f"comm hook state: checkpoint and this run disagree on error feedback (this run is {have} it)"
            )
        segments = [tuple(segment) for segment in state.get("segments", [])]
        unknown = sorted({name for segment in segments for name in segment} - set(self.param_index))
        if saved is not None:
            unknown = sorted(set(unknown) | (set(saved.get("residuals", {})) - set(self.param_index)))
        if unknown:
            raise ValueError(f"comm hook state has residuals for unknown parameters: {', '.join(unknown)}")
        if saved is not None:
            self.error_feedback.load_state_dict(saved)
        self.segments = segments
        self._segments_of.clear()
        self.step = int(state["step"])


def bucket_pieces(state: CompressionHookState, bucket: dist.GradBucket) -> list[Piece]:
    """The parameters' gradients in ``bucket``, in bucket order, named as the state knows them."""
    pieces, offset = [], 0
    for parameter in bucket.parameters():
        pieces.append(Piece(state.param_names[id(parameter)], offset, parameter.numel(), parameter.shape))
        offset += parameter.numel()
    return pieces


def rebuilt_buckets(model: nn.Module, sample: torch.Tensor, bucket_cap_mb: float = 25.0) -> list[tuple[str, ...]]:
    """The buckets DDP rebuilds after its first backward pass, as parameter names in bucket order.

    DDP orders parameters by when their gradients became ready in that pass and cuts buckets at
    ``dist._DEFAULT_FIRST_BUCKET_BYTES`` then ``bucket_cap_mb``; this runs one backward pass of
    ``sample`` (in eval mode, gradients zeroed after) to see the same order, and cuts the same way.
    A virtual-time DDP run (:mod:`src.virtual.ddp`) compresses these units, as the hook learns them.
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    ready: list[int] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda _p, i=index: ready.append(i)) for index, (_, p) in enumerate(named)
    ]
    was_training = model.training
    model.eval()
    try:
        model(sample).float().sum().mul(0.0).backward()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    order = ready + [i for i in range(len(named)) if i not in ready]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [named[i][1] for i in order],
        [dist._DEFAULT_FIRST_BUCKET_BYTES, int(bucket_cap_mb * 2**20)],
        [False] * len(order),
        order,
    )
    return [tuple(named[i][0] for i in bucket) for bucket in buckets]
