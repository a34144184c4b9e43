"""DDP in virtual time (src/virtual/ddp.py): the same gradients as real DDP, and the ring model's time.

Claims: an uncompressed virtual DDP run is large-batch SGD (the real DDP's contract); a compressed
one ends on a real 2-rank gloo run's parameters and sends its exact bytes (the hook's own code over
DDP's own buckets); each bucket's ring all-reduce overlaps backward, as a real DDP's does; faults are refused.
"""

from __future__ import annotations

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.config import SetupError, load_config
from src.ddp.hook_state import rebuilt_buckets
from src.emulation.cost_model import ring_allreduce_s
from src.launch.ddp import run_local
from src.virtual.ddp import run_virtual_ddp
from tests.test_ps_equivalence import assert_same_parameters, baseline_parameters

pytestmark = pytest.mark.timeout(300)

BUCKETS = [
    ("classifier.3.bias", "classifier.3.weight", "classifier.1.bias", "classifier.1.weight"),
    ("features.3.weight", "features.3.bias", "features.0.weight", "features.0.bias"),
]
"""simple_cnn's buckets in a real DDP run: the classifier's gradients are ready first."""


def ddp_config(tmp_path, name: str, **fields):
    values = {
        "training.dataset": "mnist_5k",
        "training.batch_size": 16,
        "training.num_epochs": 1,
        "training.max_train_samples": 250,
        "training.max_test_samples": 64,
        "training.learning_rate": 0.05,
        "training.momentum": 0.9,
        "system.architecture": "ddp",
        "system.num_workers": 3,
        "system.clock": "virtual",
        "system.checkpoint_dir": str(tmp_path / name / "ckpt"),
        "system.log_dir": str(tmp_path / name / "logs"),
        "emulation.compute_s": 0.02,
    }
    values.update({key.replace("__", "."): value for key, value in fields.items()})
    return load_config(overrides=values)


def parameters(summary) -> dict[str, torch.Tensor]:
    return load_checkpoint(summary["checkpoint_path"])["model_state_dict"]


def test_virtual_ddp_without_compression_is_large_batch_sgd(tmp_path):
    expected = baseline_parameters(tmp_path, batch_size=3 * 16, max_train_samples=250, momentum=0.9)
    summary = run_virtual_ddp(ddp_config(tmp_path, "dense"), tensorboard=False)
    assert summary["clock"] == "virtual" and summary["steps"] == 6 and summary["samples_processed"] == 250
    assert_same_parameters(expected, parameters(summary))


def test_each_buckets_ring_all_reduce_starts_when_every_rank_produced_it_and_overlaps_backward(tmp_path):
    """simple_cnn's two buckets (the classifier's, then the features'), 4 ranks, rank 2 four times slower; every
    layer's forward and backward an equal eighth of a step (``emulation.layer_split``). Rank 2 starts each step 3 x
    0.02 s late (its straggling comes after its backward and exchange in a real DDP), so it has the classifier's
    bucket at 0.06 + 0.01 (forward) + 0.005 (two layers' backward), and the features' at 0.08, when its backward
    ends; each bucket's ring waits for the one before it."""
    config = ddp_config(
        tmp_path,
        "timed",
        system__num_workers=4,
        emulation__uplink_mbps=1000,
        emulation__uplink_latency_ms=0.5,
        emulation__workers={2: {"slowdown": 4}},
        emulation__layer_split=[[1, 1]] * 4,
        training__max_train_samples=256,
    )
    summary = run_virtual_ddp(config, tensorboard=False)
    sizes = {name: 4 * value.numel() for name, value in parameters(summary).items()}
    classifier, features = (sum(sizes[name] for name in bucket) for bucket in BUCKETS)
    ring = [ring_allreduce_s(4, size, 1e9, 0.0005) for size in (classifier, features)]
    step = max(0.08, 0.075 + ring[0]) + ring[1]  # 4 full batches of 16 per step
    assert summary["steps"] == 4 and summary["train_time_s"] == pytest.approx(4 * step)
    assert summary["communication_time_s"] == pytest.approx(4 * (step - 0.08))  # exposed: past the slowest compute
    gradient_bytes = classifier + features
    assert summary["bytes_sent_per_rank_per_step"] == 2 * 3 * gradient_bytes // 4  # the ring's 2(N-1)/N


def test_the_buckets_are_the_ones_the_real_hook_learns(tmp_path):
    """The compression units of a real DDP run of simple_cnn (read from its checkpoint's hook state)."""
    from src.trainer import model_from_config
    from src.training.data import load_dataset

    config = ddp_config(tmp_path, "buckets")
    buckets = rebuilt_buckets(model_from_config(config), load_dataset("mnist_5k", "train").images[:1])
    assert buckets == BUCKETS


@pytest.mark.slow
def test_compressed_virtual_ddp_ends_on_the_real_runs_parameters_with_its_bytes(tmp_path):
    fields = dict(
        system__num_workers=2,
        system__compression_enabled=True,
        system__compression_type="topk",
        system__compression_ratio=0.1,
        emulation__compress_s=0.001,
        training__max_train_samples=256,
    )
    virtual = run_virtual_ddp(ddp_config(tmp_path, "virtual", **fields), tensorboard=False)
    real_config = ddp_config(tmp_path, "real", system__clock="real", **fields)
    real_config = real_config.model_copy(
        update={"emulation": type(real_config.emulation)()}
    )  # no emulation on real DDP links
    real = run_local(real_config)
    assert virtual["bytes_sent"] == real["bytes_sent"] and virtual["steps"] == real["steps"] == 8
    expected = parameters(real)
    for name, value in parameters(virtual).items():  # the hook's sums in rank order: equal up to float rounding
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_faults_are_refused_in_virtual_ddp(tmp_path):
    with pytest.raises(SetupError, match="^system.inject_faults: "):
        run_virtual_ddp(ddp_config(tmp_path, "faulty", system__inject_faults=["kill:rank=1@step=2"]), tensorboard=False)


def test_a_layer_split_of_another_model_is_refused_in_virtual_ddp(tmp_path):
    config = ddp_config(tmp_path, "split", emulation__layer_split=[[1, 1]] * 3)
    with pytest.raises(SetupError, match="^emulation.layer_split has 3 pairs; the model's streamed layers are 4: "):
        run_virtual_ddp(config, tensorboard=False)


@pytest.mark.slow
def test_virtual_ddp_without_epoch_evaluations_evaluates_only_the_runs_end(tmp_path):
    from src.metrics import read_events

    epochs = {}
    for name, on in (("every", True), ("final", False)):
        config = ddp_config(tmp_path, name, training__num_epochs=3, training__eval_at_epoch_ends=on)
        run_virtual_ddp(config, tensorboard=False)
        epochs[name] = [e["epoch"] for e in read_events(tmp_path / name / "logs" / "events.jsonl", "eval")]
    assert epochs == {"every": [1, 2, 3], "final": [3]}


def test_virtual_ddp_evaluates_at_fixed_sample_counts(tmp_path):
    """training.eval_every_samples: an evaluation each time the ranks' samples together pass a multiple (48 a step)."""
    from src.metrics import read_events

    config = ddp_config(tmp_path, "counts", training__eval_every_samples=96, training__max_train_samples=240)
    run_virtual_ddp(config, tensorboard=False)
    evals = list(read_events(tmp_path / "counts" / "logs" / "events.jsonl", "eval"))
    assert [e["samples"] for e in evals] == [96, 192, 240]  # two multiples, then the epoch's end
    assert all(e["elapsed_s"] > 0 for e in evals)
