"""The baseline trainer against a plain 20-line PyTorch loop in one process: same model, data, batches,
optimizer and threads, runs alternated, medians compared. ``scripts/bench_baseline.py`` runs it.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from src.config import load_config
from src.trainer import BaselineTrainer
from src.training.data import dataset_info, epoch_permutation, load_dataset
from src.training.models import build_model


def plain_loop(epochs: int, batch_size: int, lr: float, momentum: float, seed: int) -> float:
    """The reference: what a user would write by hand. Returns samples/s."""
    train = load_dataset("mnist_5k", "train")
    torch.manual_seed(seed)
    model = build_model("simple_cnn", dataset_info("mnist_5k"))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    samples, started = 0, time.perf_counter()
    for epoch in range(epochs):
        order = torch.tensor(epoch_permutation(len(train), epoch, seed))
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            images, labels = train.images[index], train.labels[index]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            samples += len(index)
    return samples / (time.perf_counter() - started)


def trainer_run(epochs: int, batch_size: int, lr: float, momentum: float, seed: int) -> float:
    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(
            overrides={
                "training.num_epochs": epochs,
                "training.batch_size": batch_size,
                "training.learning_rate": lr,
                "training.momentum": momentum,
                "training.seed": seed,
                "system.checkpoint_dir": f"{scratch}/ckpt",
                "system.log_dir": f"{scratch}/logs",
                "system.architecture": "baseline",
            }
        )
        summary = BaselineTrainer(config).run()
    return summary["throughput_samples_per_s"]


def run_benchmark(epochs: int, repeats: int, batch_size: int) -> dict:
    """Trainer and plain samples/s (medians of ``repeats`` alternated runs) and their ratio."""
    common = dict(epochs=epochs, batch_size=batch_size, lr=0.05, momentum=0.9, seed=0)
    plain_loop(**{**common, "epochs": 1})  # warm-up: allocator, kernels, page cache
    ours, plain = [], []
    for _ in range(repeats):
        ours.append(trainer_run(**common))
        plain.append(plain_loop(**common))
    result = {
        "benchmark": "baseline_trainer_vs_plain_loop",
        "model": "simple_cnn",
        "dataset": "mnist_5k",
        "batch_size": batch_size,
        "epochs": epochs,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "trainer_samples_per_s": round(statistics.median(ours), 1),
        "plain_loop_samples_per_s": round(statistics.median(plain), 1),
        "ratio": round(statistics.median(ours) / statistics.median(plain), 4),
        "target_ratio": 0.98,
    }
    return result
