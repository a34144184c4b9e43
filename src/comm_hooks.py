"""DDP communication hooks: an explicit ring all-reduce, and compressed gradient exchange.

(No ``from __future__ import annotations`` here: DDP checks a hook's annotations against the real
``dist.GradBucket`` / ``Future[Tensor]`` objects, and postponed annotations would be strings.)

DistributedDataParallel hands each gradient bucket (a flat tensor holding several parameters'
gradients, in the order the backward pass produces them) to a hook
``hook(state, bucket) -> torch.futures.Future[Tensor]`` whose result replaces the bucket with the
average over ranks. This module provides two hooks and the bookkeeping around them;
:func:`comm_hook_from_config` picks one from ``system``:

* no hook (``system.allreduce: default``, no compression): DDP's built-in allreduce in C++, the
  fastest path. Its bytes cannot be seen, so :class:`CommStats` records the ring-equivalent
  estimate ``2(N-1)/N`` x gradient bytes under ``estimated_bytes_*``.
* :func:`ring_allreduce_hook` (``system.allreduce: ring``): :func:`ring_allreduce_`, a
  reduce-scatter then an all-gather over point-to-point ``isend``/``irecv`` between ring
  neighbours, pipelined: each chunk travels in segments, and a segment is added (or forwarded) and
  sent on while the next ones are still arriving. Each rank sends ``2(N-1)/N`` of the bucket,
  counted from the tensors it sends.
* :func:`compression_hook` (``system.compression_enabled``): the bucket's gradients are compensated
  by error feedback, compressed as one flat tensor by :mod:`src.compression`, and the payloads are
  exchanged with one ``all_gather`` (compressed tensors cannot be summed by allreduce); each rank
  decompresses every rank's payload and averages them in rank order, so every replica gets
  bit-identical gradients. Bytes are counted from the payloads.

Both hooks return their future without blocking: the exchange runs on one background thread per
hook (buckets in DDP's order, which is the same on every rank, so collectives match), while the
backward pass goes on producing the next buckets; DDP waits for the futures before the optimizer
step. ``overlap=False`` runs the same work inline (the tests check both give identical gradients).
Each bucket's exchange is a ``hook_exchange`` span (:mod:`src.tracing`) on the thread that runs it;
how long the backward pass waited for them is measured by :mod:`src.exposed_comm`.

Compression units and exact resume. DDP puts every parameter in one bucket for a process's first
backward pass and re-buckets by gradient-arrival order from the second one on, so a resumed process
would see another layout at the step it resumes from. The compression hook therefore compresses
*segments*: the buckets of the rebuilt layout, learned when DDP first shows them and saved with the
hook state. A bucket that holds several known segments (the first pass's single bucket) is
compressed segment by segment, each in its own parameter order; so every step compresses the same
units whatever the process's history, and a resumed run reproduces the uninterrupted one exactly.
:meth:`CommHook.settle_buckets` runs one silent backward pass before training, so DDP rebuilds its
buckets before the first real step. Error feedback is kept per parameter (the residuals of a
segment are its parameters' residuals side by side), which is also what the parameter-server
worker keeps, so checkpoints read as ``{parameter name: tensor}`` whatever the bucket layout.

How to tune it: ``system.compression_ratio`` (top-k fraction of each segment; 8 bytes per kept
entry against 4 per dense entry, so ratio r sends about 2r of the dense bytes; 6 bytes, 1.5r, with
``system.compression_value_dtype`` bfloat16 or float16),
``quantization_bits``, ``warmup_steps`` (plain allreduce, ``default`` or ``ring``, for the first
steps: early gradients are the most sensitive to compression), ``error_feedback`` (leave it on for
top-k). :data:`RING_SEGMENT_BYTES` sets the ring's pipelining grain. With
``system.adaptive_compression`` the top-k ratio changes during the run
(:meth:`CommHook.set_topk_ratio`, on every rank at the same step: see :mod:`src.ddp_control`).
"""

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from src import tracing
from src.compression import TopKCompressor, decompress
from src.compression_policy import CompressionPolicy, policy_from_config
from src.config import SystemConfig
from src.error_feedback import ErrorFeedback

# Tag of the ring's point-to-point messages; each (phase, step, segment) adds its own offset so a
# message can only match the receive it was meant for.
RING_TAG = 0x52494E47  # "RING"
RING_SEGMENT_BYTES = 256 * 1024
"""Pipelining grain of the ring: small enough that adding one segment overlaps sending the next,
large enough that the per-message cost (~tens of microseconds in Python) stays small."""


def ring_allreduce_bytes(world_size: int, tensor_bytes: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``tensor_bytes``: ``2(N-1)/N`` of it."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * tensor_bytes // world_size


@dataclass
class CommStats:
    """Bytes one rank sent and received, split into measured and estimated.

    ``bytes_sent`` / ``bytes_received`` are counted from the tensors and payloads our hooks hand to
    the backend. ``estimated_bytes_*`` stand for collectives whose wire traffic we cannot see (the
    backend's own allreduce): the ring-equivalent ``2(N-1)/N`` of the tensor size.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    estimated_bytes_sent: int = 0
    estimated_bytes_received: int = 0
    hook_seconds: float = 0.0
    """Wall time of the hooks' exchanges (compress, send, receive, decompress), overlapping the
    backward pass when the hook overlaps; 0 for the built-in allreduce."""
    dense_bytes: int = 0
    """Gradient bytes (float32) this rank handed to a compressing exchange."""
    payload_bytes: int = 0
    """What those gradients weighed on the way out: one copy of this rank's payloads (before the
    ``N-1``-fold fan-out of ``all_gather``); dense during warm-up. ``dense / payload`` is the
    compression ratio."""

    def measured(self, sent: int, received: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def compressed(self, dense: int, payload: int) -> None:
        self.dense_bytes += int(dense)
        self.payload_bytes += int(payload)

    def estimated(self, sent: int, received: int) -> None:
        self.estimated_bytes_sent += int(sent)
        self.estimated_bytes_received += int(received)

    @property
    def total_sent(self) -> int:
        return self.bytes_sent + self.estimated_bytes_sent

    @property
    def total_received(self) -> int:
        return self.bytes_received + self.estimated_bytes_received

    def accounting(self) -> str:
        """How :attr:`total_sent` was obtained; see :func:`bytes_accounting`."""
        return bytes_accounting(self.bytes_sent, self.estimated_bytes_sent)


def bytes_accounting(measured: float, estimated: float) -> str:
    """``measured``, ``estimated``, ``mixed`` (e.g. estimated warm-up + measured payloads) or ``none``."""
    return {(True, False): "measured", (False, True): "estimated", (True, True): "mixed"}.get(
        (measured > 0, estimated > 0), "none"
    )


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _uses_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


class _ExchangeThread:
    """One background thread running a hook's exchanges in the order they were handed in.

    DDP calls a hook bucket by bucket in the same order on every rank; running the exchanges
    first-in first-out on one thread keeps the collectives in that order, while the backward pass
    carries on computing the next buckets' gradients.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(work())
            except BaseException as exc:  # handed to DDP, which raises it in backward()
                future.set_exception(exc)

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm-hook")
        self._executor.submit(run)
        return future

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _run(state, work: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """Hand ``work`` to the state's exchange thread, or (``overlap=False``) do it now."""
    if state.overlap:
        return state.thread.submit(work)
    return _completed(work())


@contextlib.contextmanager
def _timed(stats: CommStats) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        stats.hook_seconds += time.perf_counter() - started


# ----------------------------------------------------------------------------- ring all-reduce


def _wait_all(requests: list) -> None:
    # Each request exactly once: waiting twice on a finished gloo send blocks forever.
    for request in requests:
        request.wait()


def ring_allreduce_(tensor: torch.Tensor, group=None, *, segment_bytes: int = RING_SEGMENT_BYTES) -> tuple[int, int]:
    """Sum ``tensor`` over all ranks of ``group`` in place, with an explicit, pipelined ring.

    The flat tensor is split into N chunks. Reduce-scatter: in N-1 steps every rank sends one chunk
    to its right neighbour and adds the chunk arriving from its left one, after which rank r holds
    the full sum of chunk (r+1) mod N. All-gather: in N-1 more steps the summed chunks travel once
    round the ring, overwriting the partial ones. Every chunk moves in segments of about
    ``segment_bytes``: as soon as one segment has arrived and been added (or, in the all-gather,
    arrived) it is sent on to the next step, while the following segments are still on the wire;
    all receives of a step are posted before its data is needed, so neighbours never wait on each
    other in a cycle.

    Args:
        tensor: a contiguous tensor, the same shape on every rank; overwritten with the sum.
        group: process group (default: the world).
        segment_bytes: pipelining grain.

    Returns:
        ``(bytes_sent, bytes_received)`` by this rank, counted from the segments it sent and
        received (``2(N-1)/N`` of the tensor's bytes when N divides its size).

    Raises:
        ValueError: ``tensor`` is not contiguous.
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_allreduce_: tensor must be contiguous")
    world = _group_size(group)
    if world == 1 or tensor.numel() == 0:
        return 0, 0
    # gloo's send/recv take CPU tensors: stage through host memory unless the backend is nccl.
    staged = tensor if (tensor.device.type == "cpu" or _uses_nccl(group)) else tensor.cpu()
    flat = staged.view(-1)
    rank = dist.get_rank(group)
    right = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    left = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    grain = max(1, segment_bytes // flat.element_size())
    chunks = [list(chunk.split(grain)) if chunk.numel() else [] for chunk in flat.tensor_split(world)]
    most = max(len(segments) for segments in chunks)
    item = flat.element_size()
    counted = {"sent": 0, "received": 0}
    sends: dict[int, list] = {}  # step -> pending sends of the reduce-scatter (their buffers must not be overwritten)

    def tag(phase: int, step: int, segment: int) -> int:
        return RING_TAG + (phase * world + step) * most + segment

    def send(segment: torch.Tensor, phase: int, step: int, index: int):
        counted["sent"] += segment.numel() * item
        return dist.isend(segment, right, group=group, tag=tag(phase, step, index))

    def receive(into: torch.Tensor, phase: int, step: int, index: int):
        counted["received"] += into.numel() * item
        return dist.irecv(into, left, group=group, tag=tag(phase, step, index))

    # Reduce-scatter: step k sends chunk (r - k) and receives chunk (r - k - 1) into a scratch
    # buffer (two, alternating, so step k+1's receives can be posted while step k is added).
    scratch = [[torch.empty_like(segment) for segment in max(chunks, key=len)] for _ in range(2)]
    pending = []
    if world > 1:
        incoming = chunks[(rank - 1) % world]
        pending = [receive(scratch[0][j][: segment.numel()], 0, 0, j) for j, segment in enumerate(incoming)]
        sends[0] = [send(segment, 0, 0, j) for j, segment in enumerate(chunks[rank])]
    all_gather_pending: list = []
    for step in range(world - 1):
        receiving = (rank - step - 1) % world
        last = step == world - 2
        following = []
        if not last:  # post the next step's receives before working through this one's
            incoming = chunks[(rank - step - 2) % world]
            following = [
                receive(scratch[(step + 1) % 2][j][: segment.numel()], 0, step + 1, j)
                for j, segment in enumerate(incoming)
            ]
        else:  # the all-gather's first receives: chunk r, once its reduce-scatter send has left
            _wait_all(sends.pop(0, []))
            all_gather_pending = [receive(segment, 1, 0, j) for j, segment in enumerate(chunks[rank % world])]
        outgoing = []
        for j, segment in enumerate(chunks[receiving]):
            pending[j].wait()
            segment.add_(scratch[step % 2][j][: segment.numel()])
            # summed so far: on to the next reduce-scatter step, or (fully summed) the all-gather
            outgoing.append(send(segment, 0, step + 1, j) if not last else send(segment, 1, 0, j))
        sends[step + 1] = outgoing
        pending = following
    # All-gather: step k receives chunk (r - k) (posted above for k = 0) and forwards it at step k+1.
    pending = all_gather_pending
    forwarded = []
    for step in range(world - 1):
        receiving = (rank - step) % world
        following = []
        if step + 1 < world - 1:
            _wait_all(sends.pop(step + 1, []))  # that chunk's reduce-scatter send must have left
            following = [
                receive(segment, 1, step + 1, j) for j, segment in enumerate(chunks[(rank - step - 1) % world])
            ]
        for j, segment in enumerate(chunks[receiving]):
            pending[j].wait()
            if step + 1 < world - 1:
                forwarded.append(send(segment, 1, step + 1, j))
        pending = following
    for requests in [*sends.values(), forwarded]:
        _wait_all(requests)
    if staged is not tensor:
        tensor.copy_(staged)
    return counted["sent"], counted["received"]


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
    thread: _ExchangeThread = field(default_factory=_ExchangeThread)

    def close(self) -> None:
        self.thread.close()


def ring_allreduce_hook(state: RingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: average the bucket with :func:`ring_allreduce_`, off the backward pass."""
    buffer = bucket.buffer()
    step, index = state.step, bucket.index()
    if bucket.is_last():
        state.step += 1

    def exchange() -> torch.Tensor:
        with _timed(state.stats), tracing.span("hook_exchange", step=step, bucket=index):
            state.stats.measured(*ring_allreduce_(buffer, state.group))
            return buffer.div_(_group_size(state.group))

    return _run(state, exchange)


# ----------------------------------------------------------------------------- plain exchanges


def _backend_allreduce(buffer: torch.Tensor, group, stats: CommStats) -> None:
    dist.all_reduce(buffer, group=group)
    nbytes = ring_allreduce_bytes(_group_size(group), buffer.numel() * buffer.element_size())
    stats.estimated(nbytes, nbytes)


def _ring_allreduce(buffer: torch.Tensor, group, stats: CommStats) -> None:
    stats.measured(*ring_allreduce_(buffer, group))


#: ``system.allreduce`` -> in-place sum used for uncompressed exchanges (compression warm-up).
PLAIN_ALLREDUCE: Mapping[str, Callable[[torch.Tensor, Any, CommStats], None]] = {
    "default": _backend_allreduce,
    "ring": _ring_allreduce,
}


# ----------------------------------------------------------------------------- compression hook


@dataclass(frozen=True)
class _Piece:
    """One parameter's gradient inside a bucket."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class _Segment:
    """One compression unit: parameters compressed together, in this order."""

    pieces: tuple[_Piece, ...]
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
    """State of :func:`compression_hook`: policy, segments, residuals per parameter, step, byte counts.

    Args:
        policy: compressor + warm-up steps + small-tensor skip rule. During warm-up the bucket goes
            through ``plain_allreduce`` (no residuals are touched); afterwards each segment is
            sent with ``policy.compressor_for(step, numel)`` (identity for segments too small to gain).
        param_names: ``id(parameter) -> name`` for the wrapped module's parameters (residual keys).
        error_feedback: keep what compression dropped and add it to the next gradient.
        plain_allreduce: a key of :data:`PLAIN_ALLREDUCE` for uncompressed steps.
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
        self.thread = _ExchangeThread()
        self.segments: list[tuple[str, ...]] = []
        """The compression units: DDP's rebuilt buckets, as parameter names in bucket order."""
        self.passes = 0
        """Backward passes this process has seen (the first has DDP's provisional single bucket)."""
        self.probing = False
        """A silent pass (see :meth:`CommHook.settle_buckets`): hand the bucket back untouched."""
        self._segments_of: dict[tuple[str, ...], list[_Segment]] = {}

    def close(self) -> None:
        self.thread.close()

    # -- segments -------------------------------------------------------------------------

    def segments_for(self, pieces: Sequence[_Piece]) -> list[_Segment]:
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
    def _segment(pieces: list[_Piece]) -> _Segment:
        side_by_side = all(b.offset == a.offset + a.numel for a, b in zip(pieces, pieces[1:]))
        return _Segment(tuple(pieces), pieces[0].offset if side_by_side else None)

    def _seed(self, step: int, rank: int, segment: _Segment) -> int:
        unit = self.param_index[segment.pieces[0].name]
        return (((self.seed * 1_000_003 + step) * 4_099 + rank) * 65_537 + unit) % (2**62)

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


def _pieces(state: CompressionHookState, bucket: dist.GradBucket) -> list[_Piece]:
    pieces, offset = [], 0
    for parameter in bucket.parameters():
        pieces.append(_Piece(state.param_names[id(parameter)], offset, parameter.numel(), parameter.shape))
        offset += parameter.numel()
    return pieces


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: compress the bucket segment by segment, ``all_gather`` the payloads, average.

    Returns at once (the exchange runs on the state's thread) unless ``state.overlap`` is off.
    """
    buffer = bucket.buffer()
    if state.probing:
        if bucket.is_last():
            state.passes += 1
        return _completed(buffer)
    segments = state.segments_for(_pieces(state, bucket))
    step, index = state.step, bucket.index()
    if bucket.is_last():
        state.step += 1
        state.passes += 1

    def exchange() -> torch.Tensor:
        with _timed(state.stats), tracing.span("hook_exchange", step=step, bucket=index):
            world = _group_size(state.group)
            if step < state.policy.warmup_steps:
                PLAIN_ALLREDUCE[state.plain_allreduce](buffer, state.group, state.stats)
                state.stats.compressed(4 * buffer.numel(), 4 * buffer.numel())
                return buffer.div_(world)
            return _compressed_average_(state, buffer, segments, step, world)

    return _run(state, exchange)


def _compensate_into(
    ef: ErrorFeedback, segment: _Segment, grads: list[torch.Tensor], flat: torch.Tensor
) -> list[torch.Tensor]:
    """``grad + residual`` of each piece into its place in ``flat`` (the same sums as ``ef.compensate``);
    returns the pieces' views of ``flat`` (each piece's compensated gradient, for ``ef.update``)."""
    views, start = [], 0
    for piece, grad in zip(segment.pieces, grads):
        out = flat[start : start + piece.numel]
        residual = ef.residual(piece.name)
        if residual is None:
            out.copy_(grad)
        else:
            torch.add(grad, residual.reshape(-1).to(grad.device), out=out)
        views.append(out)
        start += piece.numel
    return views


def encode_segments(
    state: CompressionHookState, buffer: torch.Tensor, segments: Sequence[_Segment], step: int, rank: int
) -> tuple[list[bytes], list[list[torch.Tensor]]]:
    """One rank's payloads for ``buffer``'s segments (error feedback's compensation, then compression), and the
    compensated parts (:func:`accumulate_payloads` settles the residuals with them)."""
    ef = state.error_feedback
    compensated: list[list[torch.Tensor]] = []
    payloads = []
    for segment in segments:
        parts = [buffer[piece.offset : piece.offset + piece.numel] for piece in segment.pieces]
        if ef is not None:  # grad + residual, written side by side into one new tensor: no per-parameter copies
            flat = torch.empty(segment.numel, dtype=torch.float32, device=buffer.device)
            parts = _compensate_into(ef, segment, parts, flat)
        elif segment.start is not None:
            flat = buffer[segment.start : segment.start + segment.numel]
        else:
            flat = torch.cat(parts)
        compensated.append(parts)
        payloads.append(state.policy.compress(flat, step, seed=state._seed(step, rank, segment)))
    # Every rank derives the same lengths from the same segment sizes and step, which is what
    # lets all_gather (equal sizes required) run without exchanging lengths first.
    expected = sum(
        state.policy.compressor_for(step, segment.numel).wire_size_for(segment.numel) for segment in segments
    )
    if sum(len(payload) for payload in payloads) != expected:
        raise RuntimeError(f"compression_hook: payloads are {sum(len(p) for p in payloads)} bytes, expected {expected}")
    return payloads, compensated


def accumulate_payloads(
    state: CompressionHookState,
    totals: list[torch.Tensor | None],
    data,
    segments: Sequence[_Segment],
    lengths: Sequence[int],
    device: torch.device,
    *,
    compensated: list[list[torch.Tensor]] | None = None,
    into: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """Add one rank's decompressed payloads (``data``: their bytes side by side) to ``totals``, segment by segment.

    With ``compensated`` (the payloads are this rank's own), its residuals keep what compression dropped.
    With ``into``, a segment's first total is written into its tensor there (the bucket's own slice when the
    segment lies side by side in it: no temporary, no copy back). Called for the ranks in rank order, so every
    replica sums identically.
    """
    ef = state.error_feedback if compensated is not None else None
    position = 0
    for index, (segment, length) in enumerate(zip(segments, lengths)):
        dense = decompress(data[position : position + length]).to(device)
        position += length
        if ef is not None:
            start = 0
            for piece, part in zip(segment.pieces, compensated[index]):
                sent = dense[start : start + piece.numel]
                ef.update(piece.name, part.view(piece.shape), sent.view(piece.shape))
                ef.commit(piece.name)  # DDP never rejects a send: no rollback copy needed
                start += piece.numel
        if totals[index] is not None:
            totals[index].add_(dense)
        elif into is not None and into[index] is not None:
            totals[index] = into[index].copy_(dense)
        else:
            totals[index] = dense


def write_average_(
    buffer: torch.Tensor, segments: Sequence[_Segment], totals: Sequence[torch.Tensor], world: int
) -> torch.Tensor:
    """``buffer``'s segments become the mean of ``totals`` over ``world`` ranks."""
    for segment, total in zip(segments, totals):
        total.div_(world)
        if segment.start is not None:
            view = buffer[segment.start : segment.start + segment.numel]
            if total.data_ptr() != view.data_ptr():  # not already summed in place
                view.copy_(total)
        else:
            start = 0
            for piece in segment.pieces:
                buffer[piece.offset : piece.offset + piece.numel].copy_(total[start : start + piece.numel])
                start += piece.numel
    return buffer


def _compressed_average_(
    state: CompressionHookState, buffer: torch.Tensor, segments: list[_Segment], step: int, world: int
) -> torch.Tensor:
    rank = dist.get_rank(state.group)
    payloads, compensated = encode_segments(state, buffer, segments, step, rank)
    lengths = [len(payload) for payload in payloads]
    local = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    comm_device = buffer.device if _uses_nccl(state.group) else torch.device("cpu")
    local = local.to(comm_device)
    gathered = torch.empty(world * local.numel(), dtype=torch.uint8, device=comm_device)
    dist.all_gather_single(gathered, local, group=state.group)
    state.stats.measured((world - 1) * local.numel(), (world - 1) * local.numel())
    state.stats.compressed(4 * sum(segment.numel for segment in segments), local.numel())

    data = memoryview(gathered.cpu().numpy())
    totals: list[torch.Tensor | None] = [None] * len(segments)
    # A segment lying side by side in the bucket is summed straight into it (no temporary, no copy back).
    into = [buffer[s.start : s.start + s.numel] if s.start is not None else None for s in segments]
    for source in range(world):  # fixed rank order: every replica sums identically
        own = source * local.numel()
        accumulate_payloads(
            state,
            totals,
            data[own : own + local.numel()],
            segments,
            lengths,
            buffer.device,
            compensated=compensated if source == rank else None,
            into=into,
        )
    return write_average_(buffer, segments, totals, world)


def rebuilt_buckets(model: nn.Module, sample: torch.Tensor, bucket_cap_mb: float = 25.0) -> list[tuple[str, ...]]:
    """The buckets DDP rebuilds after its first backward pass, as parameter names in bucket order.

    DDP orders parameters by when their gradients became ready in that pass and cuts buckets at
    ``dist._DEFAULT_FIRST_BUCKET_BYTES`` then ``bucket_cap_mb``; this runs one backward pass of
    ``sample`` (in eval mode, gradients zeroed after) to see the same order, and cuts the same way.
    A virtual-time DDP run (:mod:`src.virtual_ddp`) compresses these units, as the hook learns them.
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


# ----------------------------------------------------------------------------- selection


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
        """Compress with top-k ratio ``ratio`` from the next step on (the adaptive controller, :mod:`src.ddp_control`).

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


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of all gradients DDP reduces each step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


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
        world_size=_group_size(group),
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
        world_size=_group_size(group),
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
        return CommHook("allreduce", world_size=_group_size(group), gradient_bytes=gradient_bytes(model))
    raise ValueError(f"system.allreduce: must be one of {sorted(PLAIN_ALLREDUCE)}, got {system.allreduce!r}")


__all__ = [
    "CommHook",
    "CommStats",
    "CompressionHookState",
    "PLAIN_ALLREDUCE",
    "RING_SEGMENT_BYTES",
    "RingHookState",
    "bytes_accounting",
    "comm_hook_from_config",
    "compression_comm_hook",
    "compression_hook",
    "gradient_bytes",
    "ring_allreduce_",
    "ring_allreduce_bytes",
    "ring_allreduce_hook",
    "ring_comm_hook",
]
