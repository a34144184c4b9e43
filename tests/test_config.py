"""Config schema: every rule, file loading, precedence, and the one-line error format."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from src.config import Config, ConfigError, load_config, validate_config
from tests.python_command import run_command

ROOT = Path(__file__).resolve().parent.parent


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    return caught.value.problems


def test_defaults_are_valid():
    config = Config()
    assert config.training.dataset == "mnist_5k"
    assert config.system.heartbeat_timeout > config.system.heartbeat_interval


@pytest.mark.parametrize(
    ("section", "field", "value", "expected"),
    [
        ("training", "batch_size", 0, "training.batch_size: must be > 0, got 0"),
        ("training", "batch_size", -3, "training.batch_size: must be > 0, got -3"),
        ("training", "batch_size", 1.5, "training.batch_size: must be an integer, got 1.5"),
        ("training", "learning_rate", 0, "training.learning_rate: must be a finite number > 0, got 0"),
        ("training", "learning_rate", -0.1, "training.learning_rate: must be a finite number > 0, got -0.1"),
        ("training", "learning_rate", "fast", "training.learning_rate: must be a number, got 'fast'"),
        ("training", "num_epochs", 0, "training.num_epochs: must be > 0, got 0"),
        (
            "training",
            "dataset",
            "imagenet",
            "training.dataset: must be one of 'mnist', 'fashion_mnist', 'cifar10', 'mnist_5k' or 'synthetic', "
            "got 'imagenet'",
        ),
        ("training", "model_architecture", "", "training.model_architecture: must be a non-empty model name, got ''"),
        (
            "training",
            "model_architecture",
            "vgg99",
            "training.model_architecture: unknown model (known: mlp, resnet18, simple_cnn, wide_mlp), got 'vgg99'",
        ),
        ("training", "checkpoint_interval", 0, "training.checkpoint_interval: must be > 0, got 0"),
        ("training", "momentum", 1.0, "training.momentum: must be in [0, 1), got 1.0"),
        ("training", "weight_decay", -1, "training.weight_decay: must be a finite number >= 0, got -1"),
        (
            "training",
            "max_train_samples",
            0,
            "training.max_train_samples: must be > 0 (or omitted for all samples), got 0",
        ),
        (
            "training",
            "max_test_samples",
            -5,
            "training.max_test_samples: must be > 0 (or omitted for all samples), got -5",
        ),
        ("training", "num_samples", 0, "training.num_samples: must be > 0, got 0"),
        ("training", "optimizer", "lbfgs", "training.optimizer: must be one of 'sgd' or 'adam', got 'lbfgs'"),
        ("training", "device", "tpu", "training.device: must be cpu, cuda, cuda:N or auto, got 'tpu'"),
        ("system", "num_workers", 0, "system.num_workers: must be > 0, got 0"),
        (
            "system",
            "architecture",
            "mesh",
            "system.architecture: must be one of 'baseline', 'parameter_server' or 'ddp', got 'mesh'",
        ),
        ("system", "aggregation_mode", "semi", "system.aggregation_mode: must be one of 'sync' or 'async', got 'semi'"),
        ("system", "compression_enabled", "maybe", "system.compression_enabled: must be true or false, got 'maybe'"),
        (
            "system",
            "compression_type",
            "powersgd",
            "system.compression_type: must be one of 'quantization' or 'topk', got 'powersgd'",
        ),
        ("system", "compression_ratio", 1.5, "system.compression_ratio: must be in (0, 1], got 1.5"),
        ("system", "compression_ratio", 0, "system.compression_ratio: must be in (0, 1], got 0"),
        ("system", "quantization_bits", 3, "system.quantization_bits: must be one of 2, 4 or 8, got 3"),
        ("system", "quantization_bucket_size", 0, "system.quantization_bucket_size: must be > 0, got 0"),
        (
            "system",
            "topk_selection",
            "random",
            "system.topk_selection: must be one of 'exact' or 'sampled', got 'random'",
        ),
        ("system", "warmup_steps", -1, "system.warmup_steps: must be >= 0, got -1"),
        ("system", "heartbeat_interval", 0, "system.heartbeat_interval: must be a finite number > 0, got 0"),
        ("system", "heartbeat_timeout", -1, "system.heartbeat_timeout: must be a finite number > 0, got -1"),
        ("system", "checkpoint_dir", " ", "system.checkpoint_dir: must be a non-empty path, got ' '"),
        ("system", "log_dir", "", "system.log_dir: must be a non-empty path, got ''"),
        (
            "system",
            "server_address",
            "localhost",
            "system.server_address: must be host:port with a port in 0..65535, got 'localhost'",
        ),
        (
            "system",
            "server_address",
            "host:99999",
            "system.server_address: must be host:port with a port in 0..65535, got 'host:99999'",
        ),
        ("system", "allreduce", "tree", "system.allreduce: must be one of 'default' or 'ring', got 'tree'"),
        ("system", "backend", "mpi", "system.backend: must be one of 'auto', 'gloo' or 'nccl', got 'mpi'"),
    ],
)
def test_each_rule_names_field_value_and_rule(section, field, value, expected):
    assert problems({section: {field: value}}) == [expected]


def test_heartbeat_timeout_must_exceed_interval():
    assert problems({"system": {"heartbeat_interval": 2.0, "heartbeat_timeout": 2.0}}) == [
        "system.heartbeat_timeout: must be > system.heartbeat_interval (2.0), got 2.0"
    ]
    config = validate_config({"system": {"heartbeat_interval": 2.0, "heartbeat_timeout": 2.5}})
    assert config.system.heartbeat_timeout == 2.5


def test_unknown_keys_are_errors_at_every_level():
    assert problems({"training": {"batchsize": 32}}) == ["training.batchsize: unknown key"]
    assert problems({"sytem": {}}) == ["sytem: unknown key"]


def test_every_problem_is_reported_at_once():
    found = problems({"training": {"batch_size": 0, "learning_rate": -1}, "system": {"compression_ratio": 2}})
    assert len(found) == 3
    assert {line.split(":")[0] for line in found} == {
        "training.batch_size",
        "training.learning_rate",
        "system.compression_ratio",
    }


def test_yaml_and_json_files_load(tmp_path):
    data = {"training": {"batch_size": 16, "dataset": "synthetic"}, "system": {"num_workers": 3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "c.json").write_text(json.dumps(data))
    for name in ("c.yaml", "c.json"):
        config = load_config(tmp_path / name)
        assert (config.training.batch_size, config.training.dataset, config.system.num_workers) == (16, "synthetic", 3)


def test_precedence_flag_over_file_over_runner_default(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  batch_size: 16\nsystem:\n  log_dir: from_file\n")
    config = load_config(
        path,
        overrides={"training.batch_size": 8, "training.learning_rate": None},
        defaults={"system.log_dir": "runner_default", "system.checkpoint_dir": "runner_ckpt"},
    )
    assert config.training.batch_size == 8  # flag beats file
    assert config.training.learning_rate == Config().training.learning_rate  # flag not given
    assert config.system.log_dir == "from_file"  # file beats runner default
    assert config.system.checkpoint_dir == "runner_ckpt"  # runner default beats schema default


def test_bad_yaml_is_one_clear_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("training:\n  batch_size: [1, 2\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith(f"{path}: not valid YAML")


def test_top_level_must_be_mapping_and_file_must_exist(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_empty_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


def test_every_shipped_config_loads():
    """The runners' configs; the spec's experiment and matrix files beside them (``smoke_*.yaml``,
    ``matrix_*.yaml``) are experiments, checked by tests/test_experiments.py."""
    experiments = ("smoke_", "matrix_")
    shipped = sorted(p for p in (ROOT / "configs").glob("*.y*ml") if not p.name.startswith(experiments))
    expected = {
        "example_config.yaml",
        "ps_sync_mnist.yaml",
        "ps_async_quantization.yaml",
        "ps_sync_topk.yaml",
        "ps_sync_mnist_4workers.yaml",
        "ps_async_quantization_4workers.yaml",
        "ddp_mnist.yaml",
    }
    assert expected <= {p.name for p in shipped}
    for path in shipped:
        load_config(path)  # raises on any problem


def test_cli_bad_config_exits_2_with_one_line_per_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("system:\n  compression_ratio: 1.5\n  heartbeat_interval: 3\n  heartbeat_timeout: 1\n")
    result = run_command(
        [sys.executable, "run_baseline_training.py", "--config", str(path)], cwd=ROOT, env=dict(os.environ), timeout=120
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "config error: system.compression_ratio: must be in (0, 1], got 1.5",
        "config error: system.heartbeat_timeout: must be > system.heartbeat_interval (3.0), got 1",
    ]
