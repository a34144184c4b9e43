"""torch_asgc integrations: 2-worker runs of a LightningModule (ASGCStrategy) and of a Hugging Face
model with transformers.Trainer (ASGCHFTrainerCallback) reach their accuracy bar on mnist_5k; the
learning-rate schedule of each framework reaches the server, which steps at its rate at every version.

Both models are defined in tests/library_fixtures.py (no hub downloads; HF_HUB_OFFLINE=1). Each
worker is its own spawned process with its own Trainer on its half of the data, as a user runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from src.metrics import read_events
from tests.library_fixtures import (
    HF_SCHEDULE,
    LIGHTNING_SCHEDULE,
    LibraryServer,
    accuracy_of_checkpoint,
    huggingface_worker,
    library_config,
    lightning_worker,
    run_worker_processes,
    small_mlp,
)
from tests.test_lr_schedule import rates_during

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ACCURACY_BAR = 0.86  # two epochs of a 784-64-10 MLP, sync, server SGD lr 0.05 momentum 0.9: measured in docs/library.md


@pytest.mark.parametrize("framework", ["lightning", "huggingface"])
def test_two_worker_run_reaches_the_bar(tmp_path, framework):
    pytest.importorskip(
        "pytorch_lightning" if framework == "lightning" else "transformers", reason=f"pip install -e .[{framework}]"
    )
    worker = lightning_worker if framework == "lightning" else huggingface_worker
    config = library_config(
        tmp_path,
        framework,
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__learning_rate=0.05,
        training__momentum=0.9,
    )
    with LibraryServer(config) as server:
        run_worker_processes(
            worker, [(server.address, k, 2, 2, str(tmp_path / f"worker{k}")) for k in range(2)], timeout=360
        )
        summary = server.finish()
    # each worker's half (2,000 samples) in batches of 32: 63 steps per epoch, one version each (sync)
    assert summary["versions"] == 2 * 63 and summary["samples_processed"] == 2 * 4000
    accuracy = accuracy_of_checkpoint(summary["checkpoint_path"], small_mlp(), prefix="net.")
    print(f"{framework}: test accuracy {accuracy:.4f}")
    assert accuracy >= ACCURACY_BAR, f"{framework}: test accuracy {accuracy:.3f} < {ACCURACY_BAR}"


def _framework_rates(framework: str, steps: int) -> list[float]:
    """The rate each of ``steps`` optimizer steps runs at under the worker's schedule, by the framework's own code."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    if framework == "lightning":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **LIGHTNING_SCHEDULE)
    else:
        from transformers import get_scheduler

        scheduler = get_scheduler(
            HF_SCHEDULE["lr_scheduler_type"],
            optimizer,
            num_warmup_steps=HF_SCHEDULE["warmup_steps"],
            num_training_steps=steps,
        )
    return rates_during(optimizer, scheduler, steps)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["lightning", "huggingface"])
def test_the_frameworks_schedule_reaches_the_server(tmp_path, framework):
    """One worker, 320 samples in batches of 32: 10 versions, each stepped at the framework scheduler's rate."""
    pytest.importorskip(
        "pytorch_lightning" if framework == "lightning" else "transformers", reason=f"pip install -e .[{framework}]"
    )
    worker = lightning_worker if framework == "lightning" else huggingface_worker
    config = library_config(tmp_path, framework, system__aggregation_mode="sync", training__learning_rate=0.05)
    with LibraryServer(config) as server:
        run_worker_processes(worker, [(server.address, 0, 1, 1, str(tmp_path / "worker0"), 320, True)], timeout=200)
        server.finish()
    updates = list(read_events(Path(config.system.log_dir) / "server" / "events.jsonl", "update"))
    assert [u["version"] for u in updates] == list(range(1, 11))
    expected = _framework_rates(framework, 10)
    assert len(set(expected)) >= 4  # the schedule really moves
    assert [u["learning_rate"] for u in updates] == pytest.approx(expected, rel=1e-9)
