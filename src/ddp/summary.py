"""The summaries of a DDP run: what ran, and the numbers of this rank and of the whole run.

This rank's go to ``ddp_rank_<r>.json``, the run's to ``summary.json`` (rank 0). The run's numbers
are this rank's reduced over the group: samples and bytes summed, the training time the slowest
rank's. Bytes are split into measured and estimated (:mod:`src.ddp.comm_stats`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from src.config import Config
from src.ddp.comm_stats import CommStats, bytes_accounting
from src.ddp.rank import RankContext, all_reduce_floats


def run_description(config: Config, context: RankContext, comm_hook: str) -> dict[str, Any]:
    """What ran: the fields every summary of this run shares."""
    t, system = config.training, config.system
    compression = system.compression_type if system.compression_enabled else "none"
    return {
        "architecture": "ddp",
        "dataset": t.dataset,
        "num_workers": context.world_size,
        "world_size": context.world_size,
        "backend": context.backend,
        "allreduce": system.allreduce,
        "comm_hook": comm_hook,
        "compression": compression,
        "compression_ratio": system.compression_ratio if compression == "topk" else None,
        "quantization_bits": system.quantization_bits if compression == "quantization" else None,
        "error_feedback": bool(system.compression_enabled and system.error_feedback),
        "compression_value_dtype": system.compression_value_dtype if compression == "topk" else None,
        "epochs": t.num_epochs,
        "collective_timeout_s": system.collective_timeout_s,
    }


def rank_and_run_summaries(
    common: dict[str, Any],
    context: RankContext,
    stats: CommStats,
    *,
    samples: int,
    train_time: float,
    steps_run: int,
    total_time: float,
    exposed_communication_s: float,
    emulated_delay_s: float,
    amp: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's summary, the run's summary), both starting from ``common``; collective: every rank must call it.

    ``amp`` is :meth:`src.trainer.MixedPrecision.summary` (every rank skips the same steps).
    """
    world = context.world_size
    totals = all_reduce_floats(
        context,
        [
            samples,
            stats.bytes_sent,
            stats.bytes_received,
            stats.estimated_bytes_sent,
            stats.estimated_bytes_received,
            exposed_communication_s,
        ],
    )
    (slowest,) = all_reduce_floats(context, [train_time], op=dist.ReduceOp.MAX)
    rank_summary = {
        **common,
        "rank": context.rank,
        "total_time_s": total_time,
        "train_time_s": train_time,
        "throughput_samples_per_s": samples / train_time if train_time > 0 else 0.0,
        "samples_processed": samples,
        "bytes_sent": stats.total_sent,
        "bytes_received": stats.total_received,
        "bytes_sent_measured": stats.bytes_sent,
        "bytes_sent_estimated": stats.estimated_bytes_sent,
        "bytes_accounting": stats.accounting(),
        "bytes_sent_per_step": stats.total_sent / steps_run if steps_run else 0.0,
        "communication_time_s": stats.hook_seconds,
        "exposed_communication_s": exposed_communication_s,
        "emulated_delay_s": emulated_delay_s,
        **amp,
    }
    all_samples, measured, received, estimated, estimated_received, exposed = totals
    summary = {
        **common,
        "total_time_s": total_time,
        "train_time_s": slowest,
        "throughput_samples_per_s": all_samples / slowest if slowest > 0 else 0.0,
        "samples_processed": int(all_samples),
        "bytes_sent": int(measured + estimated),  # all ranks together
        "bytes_received": int(received + estimated_received),
        "bytes_sent_measured": int(measured),
        "bytes_sent_estimated": int(estimated),
        "bytes_accounting": bytes_accounting(measured, estimated),
        "bytes_sent_per_rank_per_step": (measured + estimated) / (world * steps_run) if steps_run else 0.0,
        "exposed_communication_s": exposed,  # all ranks together (src/telemetry/exposed_comm.py)
        **amp,
    }
    return rank_summary, summary
