"""torch_asgc contracts: a plain user loop through the library takes exactly our PS runner's steps.

* sync, 2 worker processes, each looping over the batches our own worker k would be handed
  (:func:`src.training.data.make_shards` order), equals ``run_parameter_server_training.py``'s run
  (:func:`src.launch.ps.run_local`) on the same config;
* async with one worker equals single-process SGD (the baseline trainer).

Tolerances are those of ``tests/test_ps_equivalence.py``.
"""

from __future__ import annotations

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.launch.ps import run_local
from src.trainer import model_from_config
from src.training.data import load_dataset
from tests.library_fixtures import (
    TOKEN,
    LibraryServer,
    equivalence_worker,
    library_config,
    plain_loop,
    run_worker_processes,
    shard_batches,
)
from tests.ps_fixtures import ps_config
from tests.test_ps_equivalence import assert_same_parameters, baseline_parameters
from torch_asgc import DistributedModel, DistributedOptimizer, connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_sync_two_worker_processes_match_the_ps_runner(tmp_path):
    fields = dict(
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__batch_size=16,
        training__max_train_samples=249,
        training__num_epochs=2,
        training__momentum=0.9,
    )
    reference = ps_config(tmp_path, "ps", **fields)
    expected = load_checkpoint(run_local(reference)["checkpoint_path"])["model_state_dict"]

    config = library_config(tmp_path, "library", **fields, training__dataset="mnist_5k")
    with LibraryServer(config) as server:
        run_worker_processes(
            equivalence_worker, [(server.address, k, 2, config.to_dict()) for k in range(2)], timeout=180
        )
        summary = server.finish()
    # 249 samples: shards of 125 and 124, 8 steps each per epoch (the last of 13 and 12 samples)
    assert summary["versions"] == 16 and summary["samples_processed"] == 2 * 249
    actual = load_checkpoint(summary["checkpoint_path"])["model_state_dict"]
    assert_same_parameters(expected, actual)


def test_async_single_worker_matches_single_process_sgd(tmp_path):
    expected = baseline_parameters(tmp_path, batch_size=16, max_train_samples=100, momentum=0.9)
    config = library_config(
        tmp_path,
        "library",
        training__dataset="mnist_5k",
        training__max_train_samples=100,
        training__momentum=0.9,
        training__batch_size=16,
        system__async_correction="none",
    )  # the lookahead point is not what one SGD loop holds
    train_set = load_dataset("mnist_5k", "train", max_samples=100)
    with LibraryServer(config) as server:
        with connect(server.address, token=TOKEN) as client:
            net = model_from_config(config)
            model = DistributedModel(net, client)
            optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), client)
            plain_loop(model, optimizer, train_set, shard_batches(100, 1, 0, 0, 0, 16))
        summary = server.finish()
    assert summary["versions"] == 7 and summary["max_staleness"] == 0
    assert_same_parameters(expected, {name: value for name, value in net.state_dict().items()})
    assert_same_parameters(expected, load_checkpoint(summary["checkpoint_path"])["model_state_dict"])
