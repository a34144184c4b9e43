"""DDP communication hooks: an explicit ring all-reduce, and compressed gradient exchange.

(No ``from __future__ import annotations`` here: DDP checks a hook's annotations against the real
``dist.GradBucket`` / ``Future[Tensor]`` objects, and postponed annotations would be strings.)

DistributedDataParallel hands each gradient bucket (a flat tensor holding several parameters'
gradients) to a hook ``hook(state, bucket) -> torch.futures.Future[Tensor]`` whose result replaces
the bucket with the average over ranks. This module provides two hooks and the bookkeeping around
them; :func:`comm_hook_from_config` picks one from ``system``:

* no hook (``system.allreduce: default``, no compression): DDP's built-in allreduce in C++, the
  fastest path. Its bytes cannot be seen, so :class:`CommStats` records the ring-equivalent
  estimate ``2(N-1)/N`` x gradient bytes under ``estimated_bytes_*``.
* :func:`ring_allreduce_hook` (``system.allreduce: ring``): :func:`ring_allreduce_`, a
  reduce-scatter then an all-gather over point-to-point ``isend``/``irecv`` between ring
  neighbours. Each rank sends ``2(N-1)/N`` of the bucket, counted from the tensors it sends.
* :func:`compression_hook` (``system.compression_enabled``): every parameter's gradient in the
  bucket is compensated by error feedback, compressed by :mod:`src.compression` into payload bytes,
  and the concatenated payloads are exchanged with ``all_gather`` (compressed tensors cannot be
  summed by allreduce); each rank decompresses every rank's payloads and averages them, in rank
  order, so every replica gets bit-identical gradients. Bytes are counted from the payloads.

Why residuals are keyed by parameter name, not by ``bucket.index()``: DDP puts every parameter in
one bucket for the first iteration and re-buckets by gradient-arrival order from the second one on
(and a resumed process starts with one bucket again). Bucket indices therefore change meaning
between iteration 0 and 1, and between an uninterrupted run and a resumed one. Compressing,
selecting top-k and keeping residuals per parameter inside each bucket makes the hook independent
of the bucket layout: a resumed run reproduces the uninterrupted trajectory exactly, and the
checkpointed residuals read as ``{parameter name: tensor}``. It is also what the parameter-server
worker does, so both architectures compress the same units.

How to tune it: ``system.compression_ratio`` (top-k fraction; 8 bytes per kept entry against 4 per
dense entry, so ratio r sends about 2r of the dense bytes), ``quantization_bits``,
``warmup_steps`` (plain allreduce, ``default`` or ``ring``, for the first steps: early gradients
are the most sensitive to compression), ``error_feedback`` (leave it on for top-k).
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from src.compression import CompressionPolicy, ErrorFeedback, decompress, policy_from_config
from src.config import SystemConfig

# Tag for the ring's point-to-point messages, so they never match another send/recv pair.
RING_TAG = 0x52494E47  # "RING"


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
    """Wall time inside Python hooks (compress, exchange, decompress); 0 for the built-in allreduce."""
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
    return {(True, False): "measured", (False, True): "estimated", (True, True): "mixed"}.get((measured > 0, estimated > 0), "none")


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _uses_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


# ----------------------------------------------------------------------------- ring all-reduce


def ring_allreduce_(tensor: torch.Tensor, group=None) -> tuple[int, int]:
    """Sum ``tensor`` over all ranks of ``group`` in place, with an explicit ring.

    The flat tensor is split into N chunks. Reduce-scatter: in N-1 steps every rank sends one chunk
    to its right neighbour and adds the chunk arriving from its left one, after which rank r holds
    the full sum of chunk (r+1) mod N. All-gather: in N-1 more steps the summed chunks travel once
    round the ring, overwriting the partial ones. Send and receive of a step are posted together,
    so neighbours never wait on each other in a cycle.

    Args:
        tensor: a contiguous tensor, the same shape on every rank; overwritten with the sum.
        group: process group (default: the world).

    Returns:
        ``(bytes_sent, bytes_received)`` by this rank, counted from the chunks it sent and received
        (``2(N-1)/N`` of the tensor's bytes when N divides its size).

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
    chunks = list(flat.tensor_split(world))
    incoming = torch.empty(max(chunk.numel() for chunk in chunks), dtype=flat.dtype, device=flat.device)
    item = flat.element_size()
    sent = received = 0

    def exchange(outgoing: torch.Tensor, into: torch.Tensor) -> None:
        nonlocal sent, received
        # Chunks can be empty (numel < N); both neighbours know the sizes, so both skip.
        requests = []
        if outgoing.numel():
            requests.append(dist.isend(outgoing, right, group=group, tag=RING_TAG))
            sent += outgoing.numel() * item
        if into.numel():
            requests.append(dist.irecv(into, left, group=group, tag=RING_TAG))
            received += into.numel() * item
        for request in requests:
            request.wait()

    for step in range(world - 1):  # reduce-scatter
        send_index, recv_index = (rank - step) % world, (rank - step - 1) % world
        into = incoming[: chunks[recv_index].numel()]
        exchange(chunks[send_index], into)
        chunks[recv_index].add_(into)
    for step in range(world - 1):  # all-gather of the summed chunks
        send_index, recv_index = (rank + 1 - step) % world, (rank - step) % world
        exchange(chunks[send_index], chunks[recv_index])
    if staged is not tensor:
        tensor.copy_(staged)
    return sent, received


@dataclass
class RingHookState:
    """State of :func:`ring_allreduce_hook`: the group, steps taken, bytes counted (nothing to checkpoint)."""

    group: Any = None
    step: int = 0
    stats: CommStats = field(default_factory=CommStats)


def ring_allreduce_hook(state: RingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: average the bucket with :func:`ring_allreduce_` (synchronously)."""
    started = time.perf_counter()
    buffer = bucket.buffer()
    sent, received = ring_allreduce_(buffer, state.group)
    state.stats.measured(sent, received)
    buffer.div_(_group_size(state.group))
    if bucket.is_last():
        state.step += 1
    state.stats.hook_seconds += time.perf_counter() - started
    return _completed(buffer)


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


class CompressionHookState:
    """State of :func:`compression_hook`: policy, residuals per parameter, step, byte counts.

    Args:
        policy: compressor + warm-up steps + small-tensor skip rule. During warm-up the bucket goes
            through ``plain_allreduce`` (no residuals are touched); afterwards each parameter is
            sent with ``policy.compressor_for(step, numel)`` (identity for tensors too small to gain).
        param_names: ``id(parameter) -> name`` for the wrapped module's parameters (residual keys).
        error_feedback: keep what compression dropped and add it to the next gradient.
        plain_allreduce: a key of :data:`PLAIN_ALLREDUCE` for uncompressed steps.
        group: process group (default: the world).
        seed: base seed of stochastic compressors; each (step, rank, parameter) gets its own
            stream, so quantization noise is independent across ranks and a resumed run draws the
            same noise as an uninterrupted one.
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
        self.step = 0
        self.stats = CommStats()

    def payload_bytes(self, numels: list[int]) -> int:
        """Length of one rank's concatenated payloads for parameters of ``numels`` at this step."""
        return sum(self.policy.compressor_for(self.step, n).wire_size_for(n) for n in numels)

    def _seed(self, rank: int, name: str) -> int:
        return (((self.seed * 1_000_003 + self.step) * 4_099 + rank) * 65_537 + self.param_index[name]) % (2**62)

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "error_feedback"}`` with CPU tensors; loadable with ``weights_only=True``."""
        saved = None
        if self.error_feedback is not None:
            saved = self.error_feedback.state_dict()
            for section in ("residuals", "pending"):
                saved[section] = {name: tensor.detach().cpu() for name, tensor in saved[section].items()}
        return {"step": self.step, "error_feedback": saved}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: error-feedback state present on one side only, or residuals for
                parameters this model does not have.
        """
        saved = state.get("error_feedback")
        if (saved is None) != (self.error_feedback is None):
            have = "with" if self.error_feedback is not None else "without"
            raise ValueError(f"comm hook state: checkpoint and this run disagree on error feedback (this run is {have} it)")
        if saved is not None:
            unknown = sorted(set(saved.get("residuals", {})) - set(self.param_index))
            if unknown:
                raise ValueError(f"comm hook state has residuals for unknown parameters: {', '.join(unknown)}")
            self.error_feedback.load_state_dict(saved)
        self.step = int(state["step"])


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: compress each gradient in the bucket, ``all_gather`` the payloads, average.

    Runs synchronously and returns a completed future (the payloads are Python bytes, so the
    exchange cannot be chained on the backend's stream anyway).
    """
    started = time.perf_counter()
    buffer = bucket.buffer()
    world = _group_size(state.group)
    if state.step < state.policy.warmup_steps:
        PLAIN_ALLREDUCE[state.plain_allreduce](buffer, state.group, state.stats)
        state.stats.compressed(buffer.numel() * 4, buffer.numel() * 4)
        buffer.div_(world)
    else:
        _compressed_average_(state, bucket, buffer, world)
    if bucket.is_last():
        state.step += 1
    state.stats.hook_seconds += time.perf_counter() - started
    return _completed(buffer)


def _compressed_average_(state: CompressionHookState, bucket: dist.GradBucket, buffer: torch.Tensor, world: int) -> None:
    rank = dist.get_rank(state.group)
    ef = state.error_feedback
    views, names, compensated, payloads = [], [], [], []
    offset = 0
    for parameter in bucket.parameters():
        count = parameter.numel()
        view = buffer[offset : offset + count].view(parameter.shape)
        offset += count
        name = state.param_names[id(parameter)]
        tensor = ef.compensate(name, view) if ef is not None else view
        payloads.append(state.policy.compress(tensor, state.step, seed=state._seed(rank, name)))
        views.append(view)
        names.append(name)
        compensated.append(tensor)
    lengths = [len(payload) for payload in payloads]
    # Every rank derives the same lengths from the same parameter sizes and step, which is what
    # lets all_gather (equal sizes required) run without exchanging lengths first.
    expected = state.payload_bytes([view.numel() for view in views])
    if sum(lengths) != expected:
        raise RuntimeError(f"compression_hook: payloads are {sum(lengths)} bytes, expected {expected}")
    local = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    comm_device = buffer.device if _uses_nccl(state.group) else torch.device("cpu")
    local = local.to(comm_device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=state.group)
    state.stats.measured((world - 1) * local.numel(), (world - 1) * local.numel())
    state.stats.compressed(4 * buffer.numel(), local.numel())

    total = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
    for source in range(world):  # fixed rank order: every replica sums identically
        data = memoryview(gathered[source].cpu().numpy())
        start = position = 0
        for index, (view, length) in enumerate(zip(views, lengths)):
            dense = decompress(data[position : position + length]).to(buffer.device).view(-1)
            position += length
            total[start : start + dense.numel()] += dense
            if source == rank and ef is not None:
                ef.update(names[index], compensated[index], dense.view(view.shape))
                ef.commit(names[index])  # DDP never rejects a send: no rollback copy needed
            start += dense.numel()
    buffer.copy_(total.div_(world))


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

    def set_step(self, step: int) -> None:
        """Start counting steps at ``step`` (a resumed run whose checkpoint has no state for this hook)."""
        if hasattr(self.state, "step"):
            self.state.step = int(step)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of all gradients DDP reduces each step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def comm_hook_from_config(system: SystemConfig, model: nn.Module, *, group=None, seed: int = 0) -> CommHook:
    """The gradient exchange ``system`` asks for, for ``model`` (the module DDP wraps).

    Compression takes precedence; its warm-up steps use ``system.allreduce``.

    Raises:
        ValueError: unknown compression type or allreduce name.
    """
    world = _group_size(group)
    common = dict(world_size=world, gradient_bytes=gradient_bytes(model))
    if system.compression_enabled:
        policy = policy_from_config(system)
        state = CompressionHookState(
            policy,
            param_names={id(p): name for name, p in model.named_parameters()},
            error_feedback=system.error_feedback,
            plain_allreduce=system.allreduce,
            group=group,
            seed=seed,
        )
        return CommHook(system.compression_type, state, compression_hook, state.stats, **common)
    if system.allreduce == "ring":
        state = RingHookState(group=group)
        return CommHook("ring", state, ring_allreduce_hook, state.stats, **common)
    if system.allreduce == "default":
        return CommHook("allreduce", **common)
    raise ValueError(f"system.allreduce: must be one of {sorted(PLAIN_ALLREDUCE)}, got {system.allreduce!r}")


__all__ = [
    "CommHook",
    "CommStats",
    "CompressionHookState",
    "PLAIN_ALLREDUCE",
    "RingHookState",
    "bytes_accounting",
    "comm_hook_from_config",
    "compression_hook",
    "gradient_bytes",
    "ring_allreduce_",
    "ring_allreduce_bytes",
    "ring_allreduce_hook",
]
