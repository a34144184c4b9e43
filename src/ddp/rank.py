"""One DDP rank's place in the job and its set-up: context, device, backend, threads, the checks before it trains.

:class:`RankContext` is where this process sits (rank, world, local rank, backend, device, restart
attempt); :func:`rank_device`, :func:`select_backend` and :func:`threads_per_rank` choose what it
runs on, :func:`check_rank_setup` refuses settings no rank can train with (checked before launch by
:mod:`src.launch.ddp` and again in each rank), and :func:`all_reduce_floats` is the small
collective over a few numbers that evaluation and the run summary share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from src.config import Config, SetupError
from src.emulation import netem


@dataclass(frozen=True)
class RankContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    attempt: int = 0
    """How many times the elastic agent restarted the group before this attempt (0: the first)."""

    @property
    def collective_device(self) -> torch.device:
        """Where the tensors of this rank's small collectives live: its GPU under nccl, else the CPU."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


def all_reduce_floats(context: RankContext, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """``values`` reduced over the group (float64; collective: every rank must call it)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=context.collective_device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda``/``auto`` put local rank k on GPU k; ``cuda:N`` is taken as given.

    Raises:
        SetupError: CUDA requested but not available.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError(f"training.device: {name} requested but CUDA is not available")
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def select_backend(requested: str, device: torch.device) -> str:
    """``auto`` -> nccl on CUDA, gloo on CPU.

    Raises:
        SetupError: nccl without CUDA.
    """
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise SetupError("system.backend: nccl requested but CUDA is not available (use gloo or auto)")
    if requested == "nccl" and device.type != "cuda":
        raise SetupError(f"system.backend: nccl needs a CUDA training.device, got {device}")
    return requested


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads for one of ``local_world_size`` ranks sharing this machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def check_rank_setup(config: Config, world_size: int) -> None:
    """Raise :class:`SetupError` for settings no rank can train with (checked before launch and in each rank).

    * ``training.amp: fp16`` with compression: the GradScaler's loss scale changes during the run,
      so error feedback's residuals would mix gradients of different scales, and an overflowed
      step's infinite gradients cannot be compressed. bf16 needs no scaler.
    * ``emulation``: ranks emulate slower compute (``slowdown``, ``step_delay_s``); links are
      emulated for parameter-server runs only.
    """
    system = config.system
    if config.training.amp == "fp16" and system.compression_enabled:
        raise SetupError(
            "training.amp: fp16 scales the gradients by a factor that changes during the run, which error "
            "feedback's residuals cannot follow; with system.compression_enabled use bf16 (no loss scaling)"
        )
    netem.check_workers(config.emulation, world_size)
    for rank in range(world_size):
        conditions = netem.conditions_for(config.emulation, rank)
        if conditions.uplink is not None or conditions.downlink is not None:
            raise SetupError(
                "emulation: DDP ranks emulate slower compute (slowdown, step_delay_s); uplink/downlink "
                "bandwidth and latency are emulated for parameter-server runs only"
            )
