"""The virtual-time driver's benchmark: its own overhead over the gradients it computes (64 workers, dense and
top-k), and its peak memory at 64 workers of 23 MB. ``scripts/bench_virtual.py`` runs it; its ``--help``
says what each figure means. Each case runs in its own spawned process, so one's peak memory does not
hide in the other's.
"""

from __future__ import annotations

import resource
import tempfile
import time

from src.common.child_processes import process_context

WORKERS = 64


def _config(tmp: str, **fields):
    from src.config import load_config

    values = {
        "training.dataset": "mnist_5k",
        "training.batch_size": 64,
        "training.num_epochs": 4,
        "training.max_test_samples": 200,
        "training.checkpoint_interval": 10**9,
        "system.num_workers": WORKERS,
        "system.aggregation_mode": "async",
        "system.clock": "virtual",
        "system.log_dir": f"{tmp}/logs",
        "system.checkpoint_dir": f"{tmp}/ckpt",
        "system.auth_token": "bench",
        "emulation.compute_s": 0.02,
        "emulation.server_update_s": 0.001,
        "emulation.server_reply_s": 0.001,
        "emulation.uplink_mbps": 250,
        "emulation.server_mbps": 1000,
    }
    values.update(fields)
    return load_config(overrides=values)


def _gradients_only(config, pushes: int) -> float:
    """Seconds of ``pushes`` forward/backward passes of the config's model on its batches, nothing else."""
    import torch

    from src.trainer import forward_backward, model_from_config
    from src.training.data import load_dataset

    t = config.training
    train = load_dataset(t.dataset, "train", data_dir=t.data_dir, max_samples=t.max_train_samples, seed=t.seed)
    model = model_from_config(config)
    model.train()
    started = time.perf_counter()
    for index in range(pushes):
        start = index * t.batch_size % len(train)
        images, labels = train.batch(list(range(start, min(start + t.batch_size, len(train)))))
        model.zero_grad(set_to_none=True)
        forward_backward(model, images, labels)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    return time.perf_counter() - started


COMPRESSED = {
    "system.compression_enabled": True,
    "system.compression_type": "topk",
    "system.compression_ratio": 0.1,
    "emulation.compress_s": 0.002,
}


def _overhead(report, fields) -> None:
    from src.virtual.run import run_virtual

    with tempfile.TemporaryDirectory() as tmp:
        config = _config(tmp, **fields)
        started = time.perf_counter()
        summary = run_virtual(config, tensorboard=False)
        wall = time.perf_counter() - started
        pushes = summary["pushes_applied"] + summary["pushes_rejected"]
        reference = _gradients_only(config, pushes)
    report.send(
        {
            "workers": WORKERS,
            "model": "simple_cnn",
            "compression": summary["compression"],
            "pushes": pushes,
            "virtual_wall_s": round(wall, 3),
            "loop_wall_s": round(summary["wall_loop_s"], 3),
            "gradients_only_s": round(reference, 3),
            "overhead_ratio": round(summary["wall_loop_s"] / reference, 3),
            "in_run_compute_s": round(summary["wall_compute_s"], 3),
            "in_run_overhead_ratio": round(summary["wall_loop_s"] / summary["wall_compute_s"], 3),
            "virtual_time_s": round(summary["total_time_s"], 3),
            "final_accuracy": summary["final_accuracy"],
            "events": summary["virtual_events"],
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        }
    )


def _memory(report, fields) -> None:
    from src.virtual.run import run_virtual

    with tempfile.TemporaryDirectory() as tmp:
        config = _config(
            tmp,
            **{
                "training.model_architecture": "wide_mlp",
                "training.max_train_samples": WORKERS * 16 * 3,
                "training.max_test_samples": 100,
            },
        )
        started = time.perf_counter()
        summary = run_virtual(config, tensorboard=False)
        wall = time.perf_counter() - started
    model_bytes = 4 * 5_843_850
    report.send(
        {
            "workers": WORKERS,
            "model": "wide_mlp",
            "model_mb": round(model_bytes / 2**20, 1),
            "pushes": summary["pushes_applied"],
            "virtual_wall_s": round(wall, 3),
            "replicas_gb": round(WORKERS * model_bytes / 2**30, 3),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "target_gb": 8,
        }
    )


def _in_child(target, fields=None) -> dict:
    context = process_context()
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=target, args=(send, fields or {}))
    child.start()
    result = receive.recv()
    child.join()
    return result


def run_benchmark(*, memory: bool = True) -> dict:
    """The overhead case, dense and compressed, and (``memory``) the memory case."""
    result = {"overhead": _in_child(_overhead), "compressed": _in_child(_overhead, COMPRESSED)}
    if memory:
        result["memory"] = _in_child(_memory)
    return result
