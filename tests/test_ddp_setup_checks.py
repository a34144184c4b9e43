"""The new DDP and baseline flags refuse what cannot run, in one line, before any rank starts.

``--collective-timeout``, ``--amp``, ``--compression-value-dtype`` and the emulation section for DDP
ranks; the runs themselves are tests/test_ddp_hang.py's and tests/test_ddp_precision.py's.
"""

from __future__ import annotations

import pytest
import yaml

import run_baseline_training
import run_ddp_training


def _main(runner, capsys, *args: str) -> tuple[int, str]:
    try:
        code = runner.main(list(args))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def _no_agent(monkeypatch):
    import torch.distributed.launcher.api as elastic

    def refuse(*_, **__):
        raise AssertionError("the elastic agent was started for a run that cannot succeed")

    monkeypatch.setattr(elastic, "elastic_launch", refuse)


def test_a_collective_timeout_must_be_positive(capsys):
    code, err = _main(run_ddp_training, capsys, "--collective-timeout", "0")
    assert code == 2
    assert err.strip() == "config error: system.collective_timeout_s: must be a finite number > 0, got 0.0"


def test_fp16_with_compression_is_refused_naming_the_field(capsys, monkeypatch, tmp_path):
    _no_agent(monkeypatch)
    code, err = _main(
        run_ddp_training, capsys, "--amp", "fp16", "--compression-enabled", "--log-dir", str(tmp_path / "logs")
    )
    assert code == 1
    assert (
        err.strip().startswith("error: training.amp: fp16 scales the gradients") and len(err.strip().splitlines()) == 1
    )


def test_link_emulation_is_refused_for_ddp_ranks(capsys, monkeypatch, tmp_path):
    _no_agent(monkeypatch)
    config = tmp_path / "links.yaml"
    config.write_text(yaml.safe_dump({"emulation": {"workers": {1: {"uplink_mbps": 100}}}}))
    code, err = _main(run_ddp_training, capsys, "--config", str(config), "--log-dir", str(tmp_path / "logs"))
    assert code == 1 and err.strip().startswith("error: emulation: DDP ranks emulate slower compute")
    config.write_text(yaml.safe_dump({"emulation": {"workers": {5: {"slowdown": 4}}}}))
    code, err = _main(run_ddp_training, capsys, "--config", str(config), "--log-dir", str(tmp_path / "logs"))
    assert code == 1 and "emulation.workers: worker ids [5] are not workers of this run" in err


@pytest.mark.parametrize("runner", [run_baseline_training, run_ddp_training])
def test_amp_takes_none_bf16_or_fp16(capsys, runner):
    code, err = _main(runner, capsys, "--amp", "fp32")
    assert code == 2 and "--amp: invalid choice: 'fp32'" in err


def test_value_dtype_is_refused_for_quantization(capsys):
    code, err = _main(
        run_ddp_training,
        capsys,
        "--compression-enabled",
        "--compression-type",
        "quantization",
        "--compression-value-dtype",
        "bfloat16",
    )
    assert code == 2 and err.strip().startswith("config error: system.compression_value_dtype: applies to top-k values")
