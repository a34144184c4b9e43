"""Uncompressed all-reduce: an explicit, pipelined ring over point-to-point messages, and the plain exchanges by name.

:func:`ring_allreduce_` is a reduce-scatter then an all-gather over ``isend``/``irecv`` between ring
neighbours; each chunk travels in segments, and a segment is added (or forwarded) and sent on while
the next ones are still arriving. Each rank sends ``2(N-1)/N`` of the tensor, counted from the
tensors it sends. :data:`PLAIN_ALLREDUCE` maps ``system.allreduce`` to an in-place sum (this ring,
or the backend's own allreduce, whose bytes are estimated), used by the ring hook and by the
compression hook's warm-up steps (:mod:`src.ddp.comm_hooks`).

How to tune it: :data:`RING_SEGMENT_BYTES` sets the ring's pipelining grain.
"""

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from src.ddp.comm_stats import CommStats, ring_allreduce_bytes

# Tag of the ring's point-to-point messages; each (phase, step, segment) adds its own offset so a
# message can only match the receive it was meant for.
RING_TAG = 0x52494E47  # "RING"
RING_SEGMENT_BYTES = 256 * 1024
"""Pipelining grain of the ring: small enough that adding one segment overlaps sending the next,
large enough that the per-message cost (~tens of microseconds in Python) stays small."""


def _wait_all(requests: list) -> None:
    # Each request exactly once: waiting twice on a finished gloo send blocks forever.
    for request in requests:
        request.wait()


class _Ring:
    """One ring all-reduce in progress: this rank's neighbours, the chunks in segments, the pending sends, the bytes.

    Message tags: each (phase, step, segment) adds its own offset to :data:`RING_TAG`, so a message can
    only match the receive it was meant for (phase 0 is the reduce-scatter, 1 the all-gather).
    """

    def __init__(self, flat: torch.Tensor, group, segment_bytes: int):
        self.group = group
        self.world = world = dist.get_world_size(group)
        self.rank = rank = dist.get_rank(group)
        self.right = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.left = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
        self.item = flat.element_size()
        grain = max(1, segment_bytes // self.item)
        self.chunks = [list(chunk.split(grain)) if chunk.numel() else [] for chunk in flat.tensor_split(world)]
        self.most = max(len(segments) for segments in self.chunks)
        self.sent = self.received = 0
        self.sends: dict[int, list] = {}
        """step -> pending sends of the reduce-scatter (their buffers must not be overwritten)"""

    def _tag(self, phase: int, step: int, segment: int) -> int:
        return RING_TAG + (phase * self.world + step) * self.most + segment

    def send(self, segment: torch.Tensor, phase: int, step: int, index: int):
        self.sent += segment.numel() * self.item
        return dist.isend(segment, self.right, group=self.group, tag=self._tag(phase, step, index))

    def receive(self, into: torch.Tensor, phase: int, step: int, index: int):
        self.received += into.numel() * self.item
        return dist.irecv(into, self.left, group=self.group, tag=self._tag(phase, step, index))

    def _receive_scratch(self, scratch: list[torch.Tensor], chunk: int, step: int) -> list:
        """Post the reduce-scatter receives of ``chunk`` at ``step`` into ``scratch``."""
        return [self.receive(scratch[j][: segment.numel()], 0, step, j) for j, segment in enumerate(self.chunks[chunk])]

    def _receive_in_place(self, chunk: int, step: int) -> list:
        """Post the all-gather receives of ``chunk`` at ``step``, straight into its segments."""
        return [self.receive(segment, 1, step, j) for j, segment in enumerate(self.chunks[chunk])]

    def reduce_scatter(self) -> list:
        """Sum chunk ``(r+1) mod N`` into place; returns the all-gather's first receives (already posted).

        Step k sends chunk (r - k) and receives chunk (r - k - 1) into a scratch buffer (two,
        alternating, so step k+1's receives can be posted while step k is added).
        """
        world, rank, chunks = self.world, self.rank, self.chunks
        scratch = [[torch.empty_like(segment) for segment in max(chunks, key=len)] for _ in range(2)]
        pending = self._receive_scratch(scratch[0], (rank - 1) % world, 0)
        self.sends[0] = [self.send(segment, 0, 0, j) for j, segment in enumerate(chunks[rank])]
        all_gather_pending: list = []
        for step in range(world - 1):
            last = step == world - 2
            following = []
            if not last:  # post the next step's receives before working through this one's
                following = self._receive_scratch(scratch[(step + 1) % 2], (rank - step - 2) % world, step + 1)
            else:  # the all-gather's first receives: chunk r, once its reduce-scatter send has left
                _wait_all(self.sends.pop(0, []))
                all_gather_pending = self._receive_in_place(rank % world, 0)
            outgoing = []
            for j, segment in enumerate(chunks[(rank - step - 1) % world]):
                pending[j].wait()
                segment.add_(scratch[step % 2][j][: segment.numel()])
                # summed so far: on to the next reduce-scatter step, or (fully summed) the all-gather
                outgoing.append(self.send(segment, 0, step + 1, j) if not last else self.send(segment, 1, 0, j))
            self.sends[step + 1] = outgoing
            pending = following
        return all_gather_pending

    def all_gather(self, pending: list) -> None:
        """Step k receives chunk (r - k) (``pending`` for k = 0) and forwards it at step k+1; then waits every send."""
        world, rank = self.world, self.rank
        forwarded = []
        for step in range(world - 1):
            following = []
            if step + 1 < world - 1:
                _wait_all(self.sends.pop(step + 1, []))  # that chunk's reduce-scatter send must have left
                following = self._receive_in_place((rank - step - 1) % world, step + 1)
            for j, segment in enumerate(self.chunks[(rank - step) % world]):
                pending[j].wait()
                if step + 1 < world - 1:
                    forwarded.append(self.send(segment, 1, step + 1, j))
            pending = following
        for requests in [*self.sends.values(), forwarded]:
            _wait_all(requests)


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
    if dist.get_world_size(group) == 1 or tensor.numel() == 0:
        return 0, 0
    # gloo's send/recv take CPU tensors: stage through host memory unless the backend is nccl.
    staged = tensor if (tensor.device.type == "cpu" or dist.get_backend(group) == "nccl") else tensor.cpu()
    ring = _Ring(staged.view(-1), group, segment_bytes)
    ring.all_gather(ring.reduce_scatter())
    if staged is not tensor:
        tensor.copy_(staged)
    return ring.sent, ring.received


def _backend_allreduce(buffer: torch.Tensor, group, stats: CommStats) -> None:
    dist.all_reduce(buffer, group=group)
    nbytes = ring_allreduce_bytes(dist.get_world_size(group), buffer.numel() * buffer.element_size())
    stats.estimated(nbytes, nbytes)


def _ring_allreduce(buffer: torch.Tensor, group, stats: CommStats) -> None:
    stats.measured(*ring_allreduce_(buffer, group))


#: ``system.allreduce`` -> in-place sum used for uncompressed exchanges (compression warm-up).
PLAIN_ALLREDUCE: Mapping[str, Callable[[torch.Tensor, Any, CommStats], None]] = {
    "default": _backend_allreduce,
    "ring": _ring_allreduce,
}
