"""Contract tests of src/studies/async_simulation.py: with one worker the simulated async run is plain sequential
training with the server's optimizer; with several, staleness is counted as the server counts it.

Tolerances: the one-worker case computes the same float32 operations in the same order as the
reference loop (the gradient on a replica that holds a copy of the parameters), so parameters agree
to 1e-6 relative / 1e-7 absolute.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from src.config import validate_config
from src.ps.state.staleness import server_optimizer
from src.studies.async_simulation import AsyncSimulation, simulate_repeats, simulation_config
from src.trainer import forward_backward, model_from_config
from src.training.data import load_dataset, make_shards

RTOL, ATOL = 1e-6, 1e-7


def _config(num_workers: int, **system):
    training = {
        "dataset": "mnist_5k",
        "num_epochs": 1,
        "max_train_samples": 640,
        "max_test_samples": 200,
        "learning_rate": 0.05,
        "momentum": 0.9,
        "seed": 0,
        "device": "cpu",
    }
    system = {"num_workers": num_workers, "aggregation_mode": "async", "async_correction": "none", **system}
    return validate_config({"training": training, "system": system})


def _simulation(config, **kwargs) -> AsyncSimulation:
    options = {"schedule": "uniform", "jitter": 0.2, "slowdown": 1.0, "sim_seed": 0, "variant": None, **kwargs}
    return AsyncSimulation(config, **options)


@pytest.mark.slow
def test_one_worker_is_sequential_training_with_the_servers_optimizer():
    config = _config(1)
    simulation = _simulation(config)
    result = simulation.run()

    t = config.training
    train = load_dataset(t.dataset, "train", data_dir=t.data_dir, max_samples=t.max_train_samples, seed=t.seed)
    model = model_from_config(config)
    optimizer = server_optimizer(config, model.parameters(), fused=False)
    steps = 0
    for indices in make_shards(len(train), 1, 0, t.seed)[0].batches(t.batch_size):
        model.zero_grad(set_to_none=True)
        forward_backward(model, *train.batch(indices))
        optimizer.step()
        steps += 1

    assert result["versions"] == steps and result["rejected"] == 0
    assert result["staleness"] == {0: steps}  # one worker never pushes on an old version
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(simulation.model.state_dict()[name], expected, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.slow
def test_several_workers_count_staleness_and_a_hard_bound_rejects_above_it():
    free = _simulation(_config(3), schedule="exponential").run()
    bounded = _simulation(_config(3, staleness_policy="hard", max_staleness=1), schedule="exponential").run()

    pushes = sum(free["staleness"].values())
    assert max(free["staleness"]) > 1, "three workers on an exponential clock push on older versions"
    assert free["versions"] == pushes and free["rejected"] == 0
    # Every worker pushes each of its batches whatever the bound; the bound rejects exactly those above it.
    assert sum(bounded["staleness"].values()) == pushes
    assert bounded["rejected"] == sum(n for tau, n in bounded["staleness"].items() if tau > 1)
    assert bounded["versions"] == pushes - bounded["rejected"]


@pytest.mark.slow
def test_the_commands_config_sets_its_fields_and_repeats_report_every_run():
    fields = {
        "workers": 2,
        "dataset": "mnist_5k",
        "epochs": 1,
        "lr": 0.05,
        "momentum": 0.9,
        "optimizer": "sgd",
        "weight_decay": 0.0,
        "ratio": 0.25,
        "staleness_policy": "none",
        "beta": 0.5,
        "max_staleness": 8,
        "correction": "lookahead",
    }
    config = simulation_config(**fields, compression="topk", system={"max_staleness": 3})
    assert (config.system.compression_type, config.system.compression_ratio) == ("topk", 0.25)
    assert (config.system.async_correction, config.system.max_staleness) == ("lookahead", 3)  # the JSON wins
    assert simulation_config(**fields, compression=None, system={}).system.compression_enabled is False

    progress = io.StringIO()
    summary = simulate_repeats(_config(2), repeats=2, progress=progress)
    runs = [json.loads(line) for line in progress.getvalue().splitlines()]
    accuracies = [run["accuracy"] for run in runs]
    assert len(runs) == 2 and all(run["seconds"] >= 0 for run in runs)
    assert summary == {"mean": sum(accuracies) / 2, "min": min(accuracies), "max": max(accuracies)}
