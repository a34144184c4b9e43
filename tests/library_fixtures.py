"""Shared helpers for the torch_asgc tests (tests/test_torch_asgc/, and the root tests that drive the library:
test_rejoin.py, test_lr_schedule.py): a served ClientLoopServer, configs, small models, worker processes.

Worker processes are forked from the framework's forkserver (:mod:`src.common.child_processes`) and run
functions of this module (importable by name in the child); every helper that starts processes kills what
is left of them when it returns.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from src.common.child_processes import process_context
from src.config import Config, load_config
from src.training.data import make_shards
from torch_asgc.server import ClientLoopServer

TOKEN = "library-test-token-0123456789"


def library_config(tmp_path: Path, name: str = "run", **fields: Any) -> Config:
    """A small client-loop server config writing under ``tmp_path/name``; ``a__b`` keys mean ``a.b``."""
    values = {
        "training.learning_rate": 0.05,
        "training.momentum": 0.0,
        "training.checkpoint_interval": 1000,
        "system.num_workers": 1,
        "system.aggregation_mode": "async",
        "system.server_address": "127.0.0.1:0",
        "system.checkpoint_dir": str(tmp_path / name / "ckpt"),
        "system.log_dir": str(tmp_path / name / "logs"),
    }
    values.update({key.replace("__", "."): value for key, value in fields.items()})
    return load_config(overrides=values)


class LibraryServer:
    """A :class:`ClientLoopServer` serving on a free loopback port; :meth:`close` stops it."""

    def __init__(self, config: Config, **kwargs: Any):
        self.server = ClientLoopServer(config, token=TOKEN, tensorboard=False, **kwargs)
        self.port = self.server.start()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"{self.server.transport}://{self.address}"  # what connect() takes, naming the transport

    def finish(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until every worker has left; the run summary."""
        assert self.server.wait_until_done(timeout), "the workers did not all leave in time"
        return self.server.finalize()

    def close(self) -> None:
        self.server.stop(grace=0)

    def __enter__(self) -> "LibraryServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------- models defined here, not in src.training.models


class TinyConvNet(nn.Module):
    """A small CNN with batch norm (its running statistics travel as buffers); not in our registry."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.norm(self.conv(x))), 4)
        return self.head(x.flatten(1))


def simple_cnn() -> nn.Module:
    """The registry's simple_cnn for MNIST: a factory the library's server can name
    (``tests.library_fixtures:simple_cnn``), seeded by it as ``model_from_config`` seeds the runner's."""
    from src.training.data import dataset_info
    from src.training.models import build_model

    return build_model("simple_cnn", dataset_info("mnist_5k"))


def small_mlp(seed: int = 0, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))


# ----------------------------------------------------------------------------- user loops (in a worker process or here)


def shard_batches(
    num_samples: int, num_workers: int, worker: int, epoch: int, seed: int, batch_size: int
) -> list[list[int]]:
    """The batches our own PS worker ``worker`` would be handed in ``epoch`` (the same data order)."""
    return list(make_shards(num_samples, num_workers, epoch, seed)[worker].batches(batch_size))


def plain_loop(model, optimizer, train_set, batches: list[list[int]]) -> None:
    """The user's loop: forward, cross-entropy, backward, step, one batch at a time."""
    for indices in batches:
        images, labels = train_set.batch(indices)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()


def equivalence_worker(address: str, worker: int, num_workers: int, config_dict: dict[str, Any]) -> None:
    """A worker process of the equivalence test: the registry's simple_cnn, our shard order, plain SGD settings."""
    from src.config import validate_config
    from src.trainer import model_from_config
    from src.training.data import load_dataset
    from torch_asgc import DistributedModel, DistributedOptimizer, connect

    torch.set_num_threads(1)
    config = validate_config(config_dict)
    t = config.training
    train_set = load_dataset(t.dataset, "train", max_samples=t.max_train_samples)
    net = model_from_config(config)  # the same initial values as the PS runner's server
    with connect(address, token=TOKEN, worker_id=worker) as client:
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=t.learning_rate, momentum=t.momentum), client
        )
        for epoch in range(t.num_epochs):
            plain_loop(
                model,
                optimizer,
                train_set,
                shard_batches(len(train_set), num_workers, worker, epoch, t.seed, t.batch_size),
            )


def topk_worker(address: str, worker: int, num_workers: int, epochs: int, ratio: float) -> None:
    """A worker process training :class:`TinyConvNet` on its half of mnist_5k with top-k + error feedback."""
    from src.training.data import load_dataset
    from torch_asgc import DistributedModel, DistributedOptimizer, build_compressor, connect

    torch.set_num_threads(1)
    train_set = load_dataset("mnist_5k", "train")
    torch.manual_seed(100 + worker)  # different initial values: the first worker's win
    net = TinyConvNet()
    with connect(address, token=TOKEN, worker_id=worker) as client:
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.5),
            client,
            compression=build_compressor("topk", ratio=ratio),
            error_feedback=True,
        )
        for epoch in range(epochs):
            plain_loop(model, optimizer, train_set, shard_batches(len(train_set), num_workers, worker, epoch, 0, 32))


def run_worker_processes(target: Callable[..., None], args_per_worker: list[tuple], timeout: float) -> None:
    """Run ``target(*args)`` in one child process per entry; fail naming the first that did not exit 0."""
    context = process_context()
    errors = context.Queue()
    processes = [
        context.Process(target=_report_errors, args=(target, args, errors), name=f"library-worker-{k}")
        for k, args in enumerate(args_per_worker)
    ]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout)
        failed = [p for p in processes if p.exitcode != 0]
        if failed:
            details = []
            while not errors.empty():
                details.append(errors.get_nowait())
            raise AssertionError(f"{failed[0].name} exited with {failed[0].exitcode}:\n" + "\n".join(details))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def _report_errors(target: Callable[..., None], args: tuple, errors) -> None:
    try:
        target(*args)
    except BaseException:
        errors.put(traceback.format_exc())
        raise


# ------------------------------------------------------------------------ framework integrations (worker processes)


def worker_shard(worker: int, num_workers: int, max_samples: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s share of the mnist_5k training set (images, labels), of its first ``max_samples``."""
    from src.training.data import load_dataset

    train_set = load_dataset("mnist_5k", "train", max_samples=max_samples)
    indices = make_shards(len(train_set), num_workers, 0, 0)[worker].indices
    return train_set.images[indices], train_set.labels[indices]


LIGHTNING_SCHEDULE = dict(step_size=3, gamma=0.5)
"""The StepLR (stepped every optimizer step) of :func:`lightning_worker` with ``scheduled=True``."""
HF_SCHEDULE = dict(lr_scheduler_type="cosine", warmup_steps=2)
"""The Trainer's schedule of :func:`huggingface_worker` with ``scheduled=True`` (else a constant rate)."""


def lightning_worker(
    address: str,
    worker: int,
    num_workers: int,
    epochs: int,
    log_dir: str,
    max_samples: int | None = None,
    scheduled: bool = False,
) -> None:
    """A LightningModule defined here, trained with ``Trainer(strategy=ASGCStrategy(...))`` on its shard
    (``scheduled``: ``configure_optimizers`` also returns a per-step :data:`LIGHTNING_SCHEDULE`)."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from torch_asgc.plugins.lightning import ASGCStrategy

    torch.set_num_threads(1)

    class LitMLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_mlp(seed=worker)

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return F.cross_entropy(self.net(images), labels)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if not scheduled:
                return optimizer
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **LIGHTNING_SCHEDULE)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    images, labels = worker_shard(worker, num_workers, max_samples)
    loader = DataLoader(
        TensorDataset(images, labels), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(worker)
    )
    trainer = pl.Trainer(
        max_epochs=epochs,
        strategy=ASGCStrategy(address, token=TOKEN, worker_id=worker),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=log_dir,
    )
    trainer.fit(LitMLP(), loader)


def huggingface_worker(
    address: str,
    worker: int,
    num_workers: int,
    epochs: int,
    output_dir: str,
    max_samples: int | None = None,
    scheduled: bool = False,
) -> None:
    """A tiny ``PreTrainedModel`` defined here, trained by ``transformers.Trainer`` with ASGCHFTrainerCallback
    at learning rate 0.05 (the Trainer's rate and schedule reach the server: constant, or :data:`HF_SCHEDULE`)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

    from torch_asgc.plugins.huggingface import ASGCHFTrainerCallback

    torch.set_num_threads(1)

    class TinyConfig(PretrainedConfig):
        model_type = "asgc-tiny-mlp"

    class TinyClassifier(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.net = small_mlp(seed=worker)

        def forward(self, pixel_values, labels=None):
            logits = self.net(pixel_values)
            return (
                {"loss": F.cross_entropy(logits, labels), "logits": logits}
                if labels is not None
                else {"logits": logits}
            )

    images, labels = worker_shard(worker, num_workers, max_samples)
    dataset = [{"pixel_values": image, "labels": label} for image, label in zip(images, labels)]
    schedule = HF_SCHEDULE if scheduled else dict(lr_scheduler_type="constant")
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=32,
        num_train_epochs=epochs,
        learning_rate=0.05,
        **schedule,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        seed=worker,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=TinyClassifier(TinyConfig()),
        args=args,
        train_dataset=dataset,
        callbacks=[ASGCHFTrainerCallback(address, token=TOKEN, worker_id=worker)],
    )
    trainer.train()


def accuracy_of_checkpoint(path: str, module: nn.Module, prefix: str = "") -> float:
    """Test accuracy on mnist_5k of ``module`` loaded from a server checkpoint (keys under ``prefix``)."""
    from src.common.checkpoint import load_checkpoint
    from src.trainer import evaluate
    from src.training.data import load_dataset

    state = load_checkpoint(path)["model_state_dict"]
    module.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=False)
    return evaluate(module, load_dataset("mnist_5k", "test"))[1]
