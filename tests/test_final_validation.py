"""run_final_checkpoint_validation.py: passes on real runs, fails on a corrupted, swapped or disagreeing checkpoint.

The real runs (baseline, PS sync with 2 workers, DDP with 2 ranks on 512 mnist_5k samples) are
trained once per module; each failure case damages a copy of them and re-validates it with
--validate-only, so the checks, not the training, are what is exercised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import run_final_checkpoint_validation as validation
from tests.test_report import run_cli

SMALL = "--workers 2 --epochs 1 --max-train-samples 512 --max-test-samples 128 --dataset mnist_5k".split()


# ----------------------------------------------------------------------------- property 28 (fast, pure)


def _summaries(ps: float, ddp: float) -> dict:
    return {
        "baseline": {"throughput_samples_per_s": 1000.0},
        "ps_sync": {"throughput_samples_per_s": ps},
        "ddp": {"throughput_samples_per_s": ddp},
    }


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(validation, "usable_cores", lambda: 2)
    monkeypatch.setattr(validation, "_cuda_devices", lambda: 0)


def test_property_28_is_null_unless_four_workers(two_cores):
    result = validation.property_28(2, _summaries(3000.0, 3000.0))
    assert result["value"] is None and "only with --workers 4" in result["note"]
    assert result["speedups"] == {"ps_sync": 3.0, "ddp": 3.0}


def test_property_28_keeps_its_rule_and_says_when_the_machine_cannot_show_it(two_cores):
    slow = validation.property_28(4, _summaries(900.0, 1500.0), 7.5)
    assert slow["value"] is False and slow["speedups"]["ps_sync"] == 0.9
    assert "2 CPU core(s) for 4 workers" in slow["note"] and "not adjusted" in slow["note"]
    assert slow["machine"] == {"cpu_cores": 2, "cuda_devices": 0, "load_average_during_runs": 7.5}
    fast = validation.property_28(4, _summaries(1100.0, 1500.0), 7.5)
    assert (
        fast["value"] is True and "not from the workers running in parallel" in fast["note"] and "7.5" in fast["note"]
    )
    assert validation.property_28(4, {**_summaries(1100.0, 1500.0), "ddp": None})["value"] is False  # DDP did not run


def test_auto_dataset_falls_back_to_the_bundled_set(tmp_path):
    assert validation.resolve_dataset("auto", str(tmp_path))[0] == "mnist_5k"
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in validation.MNIST_FILES:
        (raw / name).write_bytes(b"")
    assert validation.resolve_dataset("auto", str(tmp_path)) == ("mnist", None)
    assert validation.resolve_dataset("mnist_5k", str(tmp_path)) == ("mnist_5k", None)


# ----------------------------------------------------------------------------- real runs (slow)


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    output = tmp_path_factory.mktemp("final_validation") / "out"
    done = run_cli(["run_final_checkpoint_validation.py", *SMALL, "--output-dir", str(output)], timeout_s=900)
    return output, done


@pytest.fixture
def damaged(validated, tmp_path):
    """A copy of the validated runs to damage (paths in the summaries point into the copy)."""
    source, _ = validated
    copy = tmp_path / "out"
    shutil.copytree(source, copy)
    for summary_path in copy.glob("runs/*/logs/summary.json"):
        summary = json.loads(summary_path.read_text())
        summary["checkpoint_path"] = summary["checkpoint_path"].replace(str(source), str(copy))
        summary_path.write_text(json.dumps(summary))
    return copy


def revalidate(output: Path):
    done = run_cli(
        ["run_final_checkpoint_validation.py", "--validate-only", "--output-dir", str(output)], timeout_s=300
    )
    return done, json.loads((output / "validation.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_passes_on_real_runs(validated):
    output, done = validated
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((output / "validation.json").read_text())
    assert result["passed"] is True and result["dataset"] == "mnist_5k" and result["workers"] == 2
    for name, run in result["runs"].items():
        assert [c["check"] for c in run["checks"]] == [
            "summary",
            "final_file",
            "weights_only",
            "strict_loader",
            "architecture",
            "rebuild",
            "step",
            "accuracy",
        ], name
        assert all(c["ok"] for c in run["checks"]), run
    assert result["speedup_ok_property_28"] is None and "--workers 4" in result["property_28"]["note"]
    assert all(s > 0 for s in result["property_28"]["speedups"].values())
    assert "speedup_ok_property_28: null" in done.stdout
    report = json.loads(Path(result["report"]["json"]).read_text())
    assert {r["architecture"] for r in report["runs"]} == {"baseline", "parameter_server", "ddp"}
    assert Path(result["report"]["html"]).is_file() and Path(result["report"]["markdown"]).is_file()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_revalidating_untouched_runs_passes(damaged):
    done, result = revalidate(damaged)
    assert done.returncode == 0 and result["passed"], done.stderr


def _truncate(output: Path) -> str:
    path = output / "runs" / "ps_sync" / "checkpoints" / "parameter_server_final.pt"
    path.write_bytes(path.read_bytes()[:4096])
    return "FAIL ps_sync: weights_only"


def _swap(output: Path) -> str:
    shutil.copyfile(
        output / "runs" / "baseline" / "checkpoints" / "baseline_final.pt",
        output / "runs" / "ddp" / "checkpoints" / "ddp_final.pt",
    )
    return "FAIL ddp: architecture: checkpoint was written by a 'baseline' run, expected 'ddp'"


def _edit_summary(output: Path, run: str, **changes) -> None:
    path = output / "runs" / run / "logs" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _accuracy_disagrees(output: Path) -> str:
    summary = json.loads((output / "runs" / "baseline" / "logs" / "summary.json").read_text())
    _edit_summary(output, "baseline", final_accuracy=summary["final_accuracy"] + 0.05)
    return "FAIL baseline: accuracy: evaluated accuracy"


def _step_disagrees(output: Path) -> str:
    summary = json.loads((output / "runs" / "ps_sync" / "logs" / "summary.json").read_text())
    _edit_summary(output, "ps_sync", versions=summary["versions"] + 1)
    return "FAIL ps_sync: step: checkpoint step"


def _final_missing(output: Path) -> str:
    (output / "runs" / "ddp" / "checkpoints" / "ddp_final.pt").unlink()  # the numbered checkpoint stays: no fallback
    return "FAIL ddp: final_file"


def _older_file(output: Path) -> str:
    folder = output / "runs" / "baseline" / "checkpoints"
    _edit_summary(output, "baseline", checkpoint_path=str(next(folder.glob("checkpoint_*.pt"))))
    return "FAIL baseline: final_file: summary's checkpoint_path is"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "damage",
    [_truncate, _swap, _accuracy_disagrees, _step_disagrees, _final_missing, _older_file],
    ids=lambda f: f.__name__.strip("_"),
)
def test_fails_on_a_bad_checkpoint_or_summary(damaged, damage):
    expected = damage(damaged)
    done, result = revalidate(damaged)
    assert done.returncode == 1, done.stdout + done.stderr
    assert result["passed"] is False
    assert expected in done.stderr, done.stderr
    failed = {name for name, run in result["runs"].items() if not run["passed"]}
    assert failed == {expected.split()[1].rstrip(":")}, result
