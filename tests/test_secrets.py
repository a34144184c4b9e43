"""The auth token is a secret: a run with it in its config file writes it nowhere and prints it nowhere."""

from __future__ import annotations

import os
import sys

import pytest

from src.config import ConfigError, load_config
from tests.ps_fixtures import ROOT
from tests.python_command import run_command

TOKEN = "sekrit-Token-5f0c2d9e"


def test_the_token_never_serializes_and_errors_do_not_echo_it():
    config = load_config(overrides={"system.auth_token": TOKEN})
    assert config.system.auth_token.get_secret_value() == TOKEN
    for text in (config.model_dump_json(), str(config.to_dict()), repr(config), str(config)):
        assert TOKEN not in text
    with pytest.raises(ConfigError) as bad:
        load_config(overrides={"system.auth_token": [TOKEN]})
    assert TOKEN not in str(bad.value) and "system.auth_token" in str(bad.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_output_file_of_any_runner_holds_the_token(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        f"training:\n  max_train_samples: 256\n  max_test_samples: 64\n  num_epochs: 1\n"
        f"system:\n  auth_token: {TOKEN}\n"
    )
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    runs = [
        ["run_parameter_server_training.py", "--workers", "2"],
        ["run_baseline_training.py"],
        ["run_ddp_training.py", "--world-size", "1"],
    ]
    printed = []
    for args in runs:
        done = run_command(
            [sys.executable, str(ROOT / args[0]), "--config", str(config_file), *args[1:]],
            cwd=outputs,
            env=dict(os.environ),
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        printed += [done.stdout, done.stderr]
        helped = run_command(
            [sys.executable, str(ROOT / args[0]), "--config", str(config_file), "--help"],
            cwd=outputs,
            env=dict(os.environ),
            timeout=60,
        )
        printed += [helped.stdout, helped.stderr]
    files = [path for path in outputs.rglob("*") if path.is_file()]
    assert len(files) > 20  # events, TensorBoard files, summaries, checkpoints of all three runs
    assert {p.suffix for p in files} >= {".pt", ".jsonl", ".json"}
    leaked = [str(path) for path in files if TOKEN.encode() in path.read_bytes()]
    assert leaked == []
    assert all(TOKEN not in text for text in printed)
