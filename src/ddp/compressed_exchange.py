"""The compression hook's exchange: compensate and compress each segment, ``all_gather`` the payloads, average.

Compressed tensors cannot be summed by allreduce, so each rank's payloads (one per segment, see
:mod:`src.ddp.hook_state`) go to every rank with one ``all_gather``; each rank decompresses
every rank's payloads and averages them in rank order, so every replica gets bit-identical
gradients. Bytes are counted from the payloads. The steps (:func:`encode_segments`,
:func:`accumulate_payloads`, :func:`write_average_`) are public because a virtual-time DDP run
(:mod:`src.virtual.ddp`) combines gradients with this same code.
"""

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from src.compression import decompress, topk_entries
from src.compressors.error_feedback import ErrorFeedback
from src.ddp.hook_state import CompressionHookState, Segment


def _compensate_into(
    ef: ErrorFeedback, segment: Segment, grads: list[torch.Tensor], flat: torch.Tensor
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
    state: CompressionHookState, buffer: torch.Tensor, segments: Sequence[Segment], step: int, rank: int
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
    segments: Sequence[Segment],
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
        payload = data[position : position + length]
        position += length
        entries = topk_entries(payload)
        if entries is not None:  # top-k: add its k entries, no dense tensor of zeros around them
            positions = torch.from_numpy(entries[0].astype(np.int64)).to(device)
            values = torch.from_numpy(entries[1]).to(device)
            if ef is not None:
                _settle_own_entries(ef, segment, compensated[index], entries[0], positions, values)
            if totals[index] is None:
                first = into[index] if into is not None else None
                totals[index] = first.zero_() if first is not None else torch.zeros(segment.numel, device=device)
            totals[index].index_add_(0, positions, values)  # distinct positions: one addition each
            continue
        dense = decompress(payload).to(device)
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


def _settle_own_entries(
    ef: ErrorFeedback,
    segment: Segment,
    parts: list[torch.Tensor],
    host_positions: np.ndarray,
    positions: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Error feedback of this rank's own top-k send, piece by piece: each piece's residual is its compensated
    gradient less the entries sent from it (``host_positions``: ``positions`` on the host, ascending)."""
    starts = np.cumsum([0] + [piece.numel for piece in segment.pieces])
    bounds = np.searchsorted(host_positions, starts).tolist()
    for piece, part, start, lo, hi in zip(segment.pieces, parts, starts.tolist(), bounds, bounds[1:]):
        ef.settle_sent_entries(piece.name, part.view(piece.shape), positions[lo:hi] - start, values[lo:hi])


def write_average_(
    buffer: torch.Tensor, segments: Sequence[Segment], totals: Sequence[torch.Tensor], world: int
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


def compressed_average_(
    state: CompressionHookState, buffer: torch.Tensor, segments: list[Segment], step: int, world: int
) -> torch.Tensor:
    rank = dist.get_rank(state.group)
    payloads, compensated = encode_segments(state, buffer, segments, step, rank)
    lengths = [len(payload) for payload in payloads]
    local = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    comm_device = buffer.device if dist.get_backend(state.group) == "nccl" else torch.device("cpu")
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
