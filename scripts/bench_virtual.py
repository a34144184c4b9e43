"""Benchmark the virtual-time driver: its own overhead at 64 workers, and its memory at 64 workers of 23 MB.

    python scripts/bench_virtual.py                       # both cases (~2 min on 2 cores)
    python scripts/bench_virtual.py --skip-memory --output bench_virtual.json

Prints one JSON object (also to ``--output``):

* ``overhead``: 64 simulated async workers of ``simple_cnn`` on ``mnist_5k`` (4 epochs of batch 64,
  dense gradients, a 250 Mbit/s uplink and a 1 Gbit/s server NIC). ``loop_wall_s`` is the simulation's
  wall time from its first event to its summary (``virtual_wall_s`` adds the set-up: data, models,
  the first optimizer's imports); its reference ``gradients_only_s`` is a plain loop computing the same
  number of forward/backward passes on batches of the same size; ``overhead_ratio`` = the first over
  the second (target <= 1.3: the event loop, the server core, the messages' bytes, the replicas and
  the event logs add at most 30%). ``in_run_overhead_ratio`` measures the same in one run: the loop's wall
  time over the part of it spent in the workers' forward/backward passes (``wall_compute_s``), so a
  load that changes between the two measurements cannot tilt it. ``compressed``: the same with top-k 0.1
  and error feedback, whose
  compression is real work on top (``compression_ratio_of_wall`` says how much).
* ``memory``: 64 workers of ``wide_mlp`` (5.8M parameters, 23 MB) pushing dense gradients for a few
  steps each; ``peak_rss_gb`` (target <= 8: at most one parameter replica, one in-flight push and one
  residual per simulated worker) beside ``replicas_gb``, what 64 replicas of the model weigh.

Each case runs in its own process, so one's peak memory does not hide in the other's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import tempfile
import time

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

    from src.data import load_dataset
    from src.trainer import forward_backward, model_from_config

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
    from src.virtual_time import run_virtual

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
    from src.virtual_time import run_virtual

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
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=target, args=(send, fields or {}))
    child.start()
    result = receive.recv()
    child.join()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-memory", action="store_true", help="only the overhead case")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    result = {"overhead": _in_child(_overhead), "compressed": _in_child(_overhead, COMPRESSED)}
    if not args.skip_memory:
        result["memory"] = _in_child(_memory)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
