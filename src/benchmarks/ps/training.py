"""Training samples/s of the parameter server against DDP: a 2-worker sync PS run per transport, a 2-worker
async run and 2-rank DDP, on the same data in the same run, each several times in turns (medians), with each
PS run's ratio to DDP (target: PS over TCP, sync, >= 0.9 of DDP).

Every run is started as the launchers start it (processes) and evaluates only at its end.
"""

from __future__ import annotations

import statistics
import tempfile

from src.benchmarks.common import log


def bench_training(num_epochs: int, batch_size: int, transports: list[str], repeats: int) -> dict:
    """Each run ``repeats`` times, in turns (the order flips every repeat); samples/s are medians."""
    from src.common.supervisor import stdout_to_stderr
    from src.config import load_config
    from src.launch.ddp import run_local as run_ddp
    from src.launch.ps import run_local

    common = {
        "training.dataset": "mnist_5k",
        "training.num_epochs": num_epochs,
        "training.batch_size": batch_size,
        "training.checkpoint_interval": 10**6,
        # no evaluation inside either training clock: DDP pauses its clock to evaluate, the PS evaluates on a
        # thread beside its workers, which on a machine they share takes their CPU (~5% of these runs)
        "training.eval_at_epoch_ends": False,
        "system.num_workers": 2,
    }
    runs = {f"ps_sync_2_workers{'' if t == 'tcp' else '_' + t}": ("sync", t) for t in transports}
    runs["ps_async_2_workers"] = ("async", transports[-1])
    runs["ddp_2_ranks"] = ("ddp", None)
    measured: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp, stdout_to_stderr():
        for repeat in range(repeats):
            for name in list(runs) if repeat % 2 == 0 else list(runs)[::-1]:
                mode, transport = runs[name]
                folders = {
                    "system.log_dir": f"{tmp}/{name}_{repeat}/logs",
                    "system.checkpoint_dir": f"{tmp}/{name}_{repeat}/ckpt",
                }
                if mode == "ddp":
                    summary = run_ddp(
                        load_config(
                            overrides={**common, **folders, "system.architecture": "ddp", "training.momentum": 0.9}
                        )
                    )
                else:
                    summary = run_local(
                        load_config(
                            overrides={
                                **common,
                                **folders,
                                "system.aggregation_mode": mode,
                                "system.transport": transport,
                                "training.momentum": 0.9 if mode == "sync" else 0.5,
                            }
                        )
                    )
                measured[name].append(summary)
                log(f"training {name} (run {repeat + 1}): {summary['throughput_samples_per_s']:.1f} samples/s")
    results = {}
    for name, summaries in measured.items():
        rates = [s["throughput_samples_per_s"] for s in summaries]
        results[name] = {
            "samples_per_s": round(statistics.median(rates), 1),
            "runs": [round(r, 1) for r in rates],
            "final_accuracy": summaries[0]["final_accuracy"],
        }
        if runs[name][1] is not None:
            results[name].update(
                transport=runs[name][1],
                communication_time_s=round(statistics.median(s["communication_time_s"] for s in summaries), 2),
                gradient_time_s=round(statistics.median(s["gradient_time_s"] for s in summaries), 2),
            )
    ddp = results["ddp_2_ranks"]["samples_per_s"]
    for name, run in results.items():
        if name.startswith("ps_"):
            run["ratio_to_ddp"] = round(run["samples_per_s"] / ddp, 3)
    if "ps_sync_2_workers" in results:
        results["ps_sync_2_workers"]["target_ratio_to_ddp"] = 0.9
    results["setup"] = (
        f"mnist_5k, {num_epochs} epoch(s), batch {batch_size} per worker/rank, simple_cnn, CPU, momentum 0.9 "
        f"(sync, DDP), evaluated only at the run's end (training.eval_at_epoch_ends false), median of {repeats} "
        "runs in turns"
    )
    return results
