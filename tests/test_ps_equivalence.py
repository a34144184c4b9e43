"""Parameter-server contracts against the baseline trainer: sync PS == large-batch SGD, async with 1 worker == SGD.

Server and workers run as separate spawned processes (:func:`run_local`), as a user's run does. The
2-worker sync run holds over both transports, and the two give the same parameters bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.config import load_config
from src.launch.ps import run_local
from src.trainer import BaselineTrainer
from tests.ps_fixtures import ps_config

pytestmark = pytest.mark.timeout(180)


def baseline_parameters(
    tmp_path, *, batch_size: int, max_train_samples: int, momentum: float
) -> dict[str, torch.Tensor]:
    config = load_config(
        overrides={
            "training.dataset": "mnist_5k",
            "training.batch_size": batch_size,
            "training.num_epochs": 1,
            "training.max_train_samples": max_train_samples,
            "training.max_test_samples": 64,
            "training.learning_rate": 0.05,
            "training.momentum": momentum,
            "system.architecture": "baseline",
            "system.num_workers": 1,
            "system.checkpoint_dir": str(tmp_path / "baseline" / "ckpt"),
            "system.log_dir": str(tmp_path / "baseline" / "logs"),
        }
    )
    trainer = BaselineTrainer(config)
    trainer.run()
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def ps_parameters(tmp_path, **fields) -> tuple[dict, dict[str, torch.Tensor]]:
    config = ps_config(tmp_path, "ps", **fields)
    summary = run_local(config)
    return summary, load_checkpoint(summary["checkpoint_path"])["model_state_dict"]


def assert_same_parameters(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


PER_WORKER_BATCH = 16


def sync_run(tmp_path, num_workers: int, max_train_samples: int, momentum: float, transport: str = "grpc"):
    return ps_parameters(
        tmp_path,
        system__num_workers=num_workers,
        system__aggregation_mode="sync",
        training__batch_size=PER_WORKER_BATCH,
        training__max_train_samples=max_train_samples,
        training__momentum=momentum,
        system__transport=transport,
    )


@pytest.mark.slow  # two 2-worker runs and a baseline: ~12 s, the fast suite's slowest test
def test_sync_over_tcp_is_sync_over_grpc_is_large_batch_sgd(tmp_path):
    """The same 2-worker sync run over each transport: the large-batch baseline's parameters within its
    tolerance, and the two transports' bit for bit (same messages, same core).

    249 = 2 shards of 125 and 124: the last step averages batches of 13 and 12 (sample-weighted).
    """
    expected = baseline_parameters(tmp_path, batch_size=2 * PER_WORKER_BATCH, max_train_samples=249, momentum=0.0)
    runs = {transport: sync_run(tmp_path / transport, 2, 249, 0.0, transport) for transport in ("grpc", "tcp")}
    for summary, actual in runs.values():
        assert summary["versions"] == 8 and summary["samples_processed"] == 249
        assert_same_parameters(expected, actual)
    grpc_params, tcp_params = runs["grpc"][1], runs["tcp"][1]
    assert tcp_params.keys() == grpc_params.keys()
    for name, value in grpc_params.items():
        assert torch.equal(tcp_params[name], value), name


@pytest.mark.slow  # three 2-worker runs (one with 2 shards) and a baseline: ~20 s
def test_sync_with_two_shards_is_sync_with_one_is_large_batch_sgd(tmp_path):
    """2 server shards (their own processes, each worker pushing to both at once) against 1, over TCP and gRPC:
    simple_cnn's layers are cut into 64 kB slices across the shards, so a tensor's pieces are stepped by two
    processes. The final checkpoint holds the whole model put together from the shards' parts: the one server's
    parameters to float32 rounding (a cut moves elements between torch's vectorized loop and its scalar tail),
    and the large-batch baseline's within its tolerance."""
    expected = baseline_parameters(tmp_path, batch_size=2 * PER_WORKER_BATCH, max_train_samples=249, momentum=0.9)
    _, one = sync_run(tmp_path / "one", 2, 249, 0.9)
    for transport in ("tcp", "grpc"):
        summary, sharded = ps_parameters(
            tmp_path / f"two-{transport}",
            system__num_workers=2,
            system__num_servers=2,
            system__shard_slice_bytes=64 << 10,
            system__aggregation_mode="sync",
            system__transport=transport,
            training__batch_size=PER_WORKER_BATCH,
            training__max_train_samples=249,
            training__momentum=0.9,
        )
        assert summary["versions"] == 8 and summary["samples_processed"] == 249
        keys = [key for shard in summary["placement"]["slices_per_shard"] for key in shard]
        assert any("#" in key for key in keys), f"no tensor was cut across the shards: {keys}"
        loads = summary["shards"]  # each shard carried its share: the bytes the workers sent went to one of them
        assert [s["shard"] for s in loads] == [0, 1] and all(s["update_s"] > 0 for s in loads)
        # the workers' pushes and pulls are what the shards took in, but for registrations, heartbeats, TCP's
        # framing and shard 0's own pull of the follower's part at the end
        carried = sum(s["bytes_in"] for s in loads)
        assert abs(summary["bytes_sent"] - carried) < 1e-3 * summary["bytes_sent"]
        assert summary["shard_imbalance"] < 1.3
        assert_same_parameters(expected, sharded)
        assert one.keys() == sharded.keys()
        for name, value in one.items():
            torch.testing.assert_close(sharded[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow  # 4 worker processes: ~20 s
def test_sync_with_uneven_shards_matches_large_batch_baseline(tmp_path):
    # 129 samples over 4 shards of 16-sample steps: shard 0 has 33, the others 32, so workers 1-3
    # take an empty third step while worker 0 contributes the one remaining sample.
    expected = baseline_parameters(tmp_path, batch_size=4 * PER_WORKER_BATCH, max_train_samples=129, momentum=0.9)
    summary, actual = sync_run(tmp_path, 4, 129, 0.9)
    assert summary["versions"] == 3 and summary["samples_processed"] == 129
    assert_same_parameters(expected, actual)


@pytest.mark.slow
def test_async_single_worker_matches_baseline(tmp_path):
    # The plain server optimizer; with the lookahead correction one worker takes Nesterov's steps
    # (tests/test_staleness.py checks that against torch's Nesterov SGD).
    expected = baseline_parameters(tmp_path, batch_size=16, max_train_samples=100, momentum=0.9)
    summary, actual = ps_parameters(
        tmp_path,
        system__num_workers=1,
        system__aggregation_mode="async",
        system__async_correction="none",
        training__batch_size=16,
        training__max_train_samples=100,
        training__momentum=0.9,
    )
    assert summary["versions"] == 7 and summary["max_staleness"] == 0
    assert_same_parameters(expected, actual)


@pytest.mark.slow
def test_async_single_worker_on_two_shards_matches_one_server_and_baseline(tmp_path):
    """Async over 2 shard processes (TCP; simple_cnn cut into 64 kB slices): one worker, so no push is stale, and
    each shard applies every push on arrival of its certificate: the whole model is the one server's, and SGD's."""
    expected = baseline_parameters(tmp_path, batch_size=16, max_train_samples=100, momentum=0.9)
    common = dict(
        system__num_workers=1,
        system__aggregation_mode="async",
        system__async_correction="none",
        system__transport="tcp",
        training__batch_size=16,
        training__max_train_samples=100,
        training__momentum=0.9,
    )
    _, one = ps_parameters(tmp_path / "one", **common)
    summary, sharded = ps_parameters(
        tmp_path / "two", system__num_servers=2, system__shard_slice_bytes=64 << 10, **common
    )
    assert summary["versions"] == 7 and summary["max_staleness"] == 0
    assert any("#" in key for shard in summary["placement"]["slices_per_shard"] for key in shard)
    assert_same_parameters(expected, sharded)
    for name, value in one.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_sync_differs_from_baseline_when_batches_differ(tmp_path):
    """The comparison above can fail: the same PS run against a baseline of the wrong batch size."""
    expected = baseline_parameters(tmp_path, batch_size=16, max_train_samples=128, momentum=0.0)
    _, actual = ps_parameters(
        tmp_path,
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__batch_size=16,
        training__max_train_samples=128,
        training__momentum=0.0,
    )
    with pytest.raises(AssertionError):
        assert_same_parameters(expected, actual)
