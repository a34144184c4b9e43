"""run_ddp_training.py as a user runs it: the spec's commands, torchrun across two "nodes", Ctrl-C, bad input.

The spec commands run as written (with the bundled ``mnist_5k`` for ``mnist``) from a temporary
working folder, so the default outputs checkpoints/ddp_cli and logs/ddp_cli land there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

import run_ddp_training
from src.metrics import read_events
from tests.ddp_fixtures import process_gone, run_together, torchrun_command
from tests.python_command import run_command

REPO = Path(__file__).resolve().parents[1]
RUNNER = str(REPO / "run_ddp_training.py")
RUN_TIMEOUT_S = 240


def _clean_env() -> dict[str, str]:
    """This environment without torchrun's variables (a test itself run under torchrun stays a local launch)."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def _run(args: list[str], cwd: Path, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return run_command([sys.executable, RUNNER, *args], cwd=cwd, env=_clean_env(), timeout=timeout)


def _outputs(cwd: Path, world: int) -> dict:
    logs = cwd / "logs" / "ddp_cli"
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["num_workers"] == world and summary["architecture"] == "ddp"
    for rank in range(world):
        assert json.loads((logs / f"ddp_rank_{rank}.json").read_text())["rank"] == rank
        assert list((logs / f"rank_{rank}").glob("events.out.tfevents.*"))
    checkpoint = torch.load(cwd / "checkpoints" / "ddp_cli" / "ddp_final.pt", weights_only=True)
    assert checkpoint["extra"]["comm_hook"]["world_size"] == world
    return summary


# ----------------------------------------------------------------------------- spec commands


@pytest.mark.slow
def test_spec_single_process_run(tmp_path):
    result = _run("--world-size 1 --dataset mnist_5k --num-epochs 1".split(), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Final Accuracy:" in result.stdout and "Throughput:" in result.stdout
    assert _outputs(tmp_path, 1)["final_accuracy"] >= 0.8


@pytest.mark.slow
def test_spec_two_process_run(tmp_path):
    result = _run("--world-size 2 --dataset mnist_5k --num-epochs 2".split(), tmp_path)
    assert result.returncode == 0, result.stderr
    summary = _outputs(tmp_path, 2)
    assert summary["final_accuracy"] >= 0.9
    assert summary["samples_processed"] == 2 * 4000
    assert result.stdout.count("Final Accuracy:") == 1  # the summary is printed once, not per rank


@pytest.mark.slow
def test_spec_synthetic_debug_run_and_resume(tmp_path):
    result = _run(
        "--dataset synthetic --world-size 2 --num-epochs 1 --num-samples 2048 --optimizer sgd".split(),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = _outputs(tmp_path, 2)
    assert summary["samples_processed"] == 2048 and summary["dataset"] == "synthetic"
    assert summary["final_accuracy"] > 0.3  # 10 classes: chance is 0.1
    # ... and --resume continues it for a second epoch from the checkpoint folder
    result = _run(
        "--dataset synthetic --world-size 2 --num-epochs 2 --num-samples 2048 --resume checkpoints/ddp_cli".split(),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    resumed = _outputs(tmp_path, 2)
    assert (resumed["steps"], resumed["steps_this_run"], resumed["samples_processed"]) == (
        2 * summary["steps"],
        summary["steps"],
        2048,
    )


@pytest.mark.slow
def test_same_script_spans_two_nodes_under_torchrun(tmp_path):
    # The README's two-node command, both "nodes" on this machine. The rendezvous store is held by
    # this test on a port the OS picked (port 0), so no port is probed and then bound by someone
    # else, and both nodes join it as clients (is_host=0); a fresh rendezvous id per run keeps
    # concurrent runs of this test apart. Both nodes are watched together: if one fails, its output
    # is shown at once beside the other's.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    command = [
        *torchrun_command(store.port, nnodes=2),
        RUNNER,
        *"--dataset synthetic --num-samples 256 --num-epochs 1 --allreduce ring".split(),
    ]
    nodes = run_together([command, command], cwd=tmp_path, env=_clean_env(), timeout=RUN_TIMEOUT_S)
    assert [(node.returncode, node.killed) for node in nodes] == [(0, False)] * 2, "\n".join(
        node.describe(f"node {index}") for index, node in enumerate(nodes)
    )
    assert sum(node.stdout.count("Final Accuracy:") for node in nodes) == 1  # rank 0 only
    summary = _outputs(tmp_path, 2)
    assert summary["samples_processed"] == 256 and summary["comm_hook"] == "ring"


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tmp_path):
    runner = subprocess.Popen(
        [
            sys.executable,
            RUNNER,
            *"--dataset synthetic --num-samples 20000 --batch-size 8 --world-size 2 --num-epochs 50".split(),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    logs = tmp_path / "logs" / "ddp_cli"
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(pids) < 2 or not all(_trained(logs, rank) for rank in range(2)):
            assert runner.poll() is None, runner.communicate()
            assert time.monotonic() < deadline, "ranks never started training"
            for rank in range(2):
                events = logs / f"rank_{rank}" / "events.jsonl"
                if rank not in pids and events.exists():
                    pids.update({rank: e["pid"] for e in read_events(events, "run_start")})
            time.sleep(0.2)  # polling interval of the condition above, not a stand-in for it
        runner.send_signal(signal.SIGINT)  # the launcher only, as `kill -INT` would
        _, stderr = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for pid in pids.values():
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert runner.returncode == 130, stderr
    assert "interrupted" in stderr
    assert all(process_gone(pid) for pid in pids.values())


# ----------------------------------------------------------------------------- a rank killed for real

# 512 samples / (2 ranks x 32) = 8 steps per epoch, 16 in all; top-k with error feedback, so the
# restarted group must also get every rank's residuals and the hook's step back. Checkpoints at
# steps 3, 6, 8 (epoch end), 9, 12, 15, 16: a kill at step 11 sends the group back to step 9, one
# step into epoch 2.
RUN_ARGS = (
    "--dataset synthetic --num-samples 512 --batch-size 32 --num-epochs 2 "
    "--compression-enabled --compression-type topk --compression-ratio 0.1 "
    "--checkpoint-interval-steps 3"
).split()
FAULT_RUN = [*RUN_ARGS, "--world-size", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The final checkpoint of FAULT_RUN without a fault, the reference of the restarted runs."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    result = _run(FAULT_RUN, cwd)
    assert result.returncode == 0, result.stderr
    return torch.load(cwd / "checkpoints" / "ddp_cli" / "ddp_final.pt", weights_only=True)


def _assert_same_training(final: dict, reference: dict) -> None:
    # Exact: the restarted group redoes steps 10-16 from the step-9 checkpoint (parameters, momentum,
    # every rank's residuals, the hook's step, the data position) with the same arithmetic, and
    # gloo's collectives on the same ranks and sizes are deterministic.
    assert final["step"] == reference["step"] == 16
    for name, value in reference["model_state_dict"].items():
        assert torch.equal(final["model_state_dict"][name], value), name
    for index, state in reference["optimizer_state_dict"]["state"].items():
        assert torch.equal(final["optimizer_state_dict"]["state"][index]["momentum_buffer"], state["momentum_buffer"])


def _assert_restarted_once_from_step_9(logs: Path, killed_rank: int) -> None:
    restarts = list(read_events(logs / "events.jsonl", "rank_restarted"))
    assert [(e["attempt"], e["step"], e["epoch_step"], Path(e["resumed_from"]).name) for e in restarts] == [
        (1, 9, 1, "checkpoint_000009.pt")
    ]
    attempts = [
        (e["attempt"], e["pid"]) for e in read_events(logs / f"rank_{killed_rank}" / "events.jsonl", "run_start")
    ]
    assert [attempt for attempt, _ in attempts] == [0, 1]
    assert process_gone(attempts[0][1])  # the SIGKILLed incarnation is gone
    summary = json.loads((logs / "summary.json").read_text())
    assert (summary["restarts"], summary["steps"], summary["steps_this_run"]) == (1, 16, 7)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkilled_rank_restarts_the_group_from_its_checkpoint(tmp_path, uninterrupted):
    result = _run([*FAULT_RUN, "--inject-fault", "kill:rank=1@step=11", "--max-restarts", "2"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "fault injection: kill:rank=1@step=11" in result.stderr
    assert "restart 1/2: the group continues from" in result.stderr  # a log line (src/telemetry/logs.py)
    _assert_restarted_once_from_step_9(tmp_path / "logs" / "ddp_cli", killed_rank=1)
    _assert_same_training(
        torch.load(tmp_path / "checkpoints" / "ddp_cli" / "ddp_final.pt", weights_only=True), uninterrupted
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkilled_rank_restarts_under_torchrun_and_an_error_that_cannot_succeed_is_not_retried(
    tmp_path, uninterrupted
):
    # torchrun's own agent and --max-restarts; this time the rank that writes checkpoints dies.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def torchrun(nproc: int, *args: str) -> list:
        command = [*torchrun_command(store.port, nproc=nproc), *args]
        return run_together([command], cwd=tmp_path, env=_clean_env(), timeout=RUN_TIMEOUT_S)

    (node,) = torchrun(2, "--max-restarts", "1", RUNNER, *FAULT_RUN, "--inject-fault", "kill:rank=0@step=11")
    assert (node.returncode, node.killed) == (0, False), node.describe("torchrun")
    assert "fault injection: kill:rank=0@step=11" in node.stderr
    _assert_restarted_once_from_step_9(tmp_path / "logs" / "ddp_cli", killed_rank=0)
    _assert_same_training(
        torch.load(tmp_path / "checkpoints" / "ddp_cli" / "ddp_final.pt", weights_only=True), uninterrupted
    )

    # Resuming that run's step-15 checkpoint (mid-epoch, 2 ranks) with 1 rank cannot succeed: the
    # first attempt says why in one line; the 2 restarts torchrun grants stop at once.
    mid_epoch = tmp_path / "checkpoints" / "ddp_cli" / "checkpoint_000015.pt"
    (node,) = torchrun(
        1,
        "--max-restarts",
        "2",
        RUNNER,
        *RUN_ARGS,
        "--resume",
        str(mid_epoch),
        "--checkpoint-dir",
        "checkpoints/second",
        "--log-dir",
        "logs/second",
    )
    assert node.returncode != 0 and not node.killed, node.describe("torchrun")
    errors = [line for line in node.stderr.splitlines() if line.startswith("error:")]
    assert errors[0].startswith(
        f"error: --resume {mid_epoch}: taken 7 steps into epoch 2 by 2 ranks x batch 32; this run has 1 x 32"
    )
    assert len(errors) == 3 and all(
        line.endswith("(an earlier attempt stopped on this; not retrying)") for line in errors[1:]
    )
    assert not (tmp_path / "logs" / "second" / "rank_0").exists()  # no attempt trained


def _trained(logs: Path, rank: int) -> bool:
    events = logs / f"rank_{rank}" / "events.jsonl"
    return events.exists() and any(True for _ in read_events(events, "train"))


# ----------------------------------------------------------------------------- bad input


def _main(capsys, *args: str) -> tuple[int, str]:
    try:
        code = run_ddp_training.main(list(args))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_world_size_zero_is_rejected(capsys):
    code, err = _main(capsys, "--world-size", "0")
    assert code == 2
    assert err.strip() == "config error: system.num_workers: must be > 0, got 0"


def test_compression_ratio_out_of_range_is_rejected(capsys):
    code, err = _main(capsys, "--compression-enabled", "--compression-ratio", "1.5")
    assert code == 2 and "system.compression_ratio" in err and len(err.strip().splitlines()) == 1


def test_nccl_without_cuda_is_one_line_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _main(capsys, "--backend", "nccl", "--log-dir", str(tmp_path / "logs"))
    assert code == 1
    assert err.strip() == "error: system.backend: nccl requested but CUDA is not available (use gloo or auto)"


@pytest.mark.filterwarnings("ignore:checkpoint .* does not exist:RuntimeWarning")
def test_missing_resume_checkpoint_is_one_line_error(capsys, tmp_path):
    code, err = _main(capsys, "--resume", str(tmp_path / "nothing_here"), "--log-dir", str(tmp_path / "logs"))
    assert code == 1
    assert err.strip().startswith("error: no usable checkpoint at") and len(err.strip().splitlines()) == 1


def test_missing_dataset_is_one_line_before_any_rank_starts(capsys, monkeypatch, tmp_path):
    import torch.distributed.launcher.api as elastic

    from src.training import data
    from src.training.data import DatasetUnavailableError

    def missing(name, split, **_):
        raise DatasetUnavailableError(f"dataset {name!r} not found under {tmp_path}")

    def no_agent(*_, **__):
        raise AssertionError("the elastic agent was started for a run that cannot succeed")

    monkeypatch.setattr(data, "load_dataset", missing)  # what check_dataset loads
    monkeypatch.setattr(elastic, "elastic_launch", no_agent)
    code, err = _main(capsys, "--dataset", "mnist", "--max-restarts", "3", "--log-dir", str(tmp_path / "logs"))
    assert code == 1
    assert err.strip() == f"error: dataset 'mnist' not found under {tmp_path}"


def _mid_epoch_checkpoint(path: Path, *, world_size: int, batch_size: int) -> Path:
    from src.common.checkpoint import save_checkpoint
    from src.config import validate_config
    from src.trainer import checkpoint_of_run, model_from_config, optimizer_from_config

    config = validate_config(
        {"training": {"dataset": "synthetic", "batch_size": batch_size}, "system": {"architecture": "ddp"}}
    )
    model = model_from_config(config)
    checkpoint = checkpoint_of_run(
        config,
        model,
        optimizer_from_config(config, model.parameters()),
        epoch=1,
        step=10,
        extra={"epoch_step": 2, "world_size": world_size},
    )
    return save_checkpoint(path, checkpoint)


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_needs_the_same_ranks_and_batch_size(capsys, tmp_path):
    checkpoint = _mid_epoch_checkpoint(tmp_path / "checkpoint_000010.pt", world_size=2, batch_size=32)
    code, err = _main(
        capsys,
        "--dataset",
        "synthetic",
        "--resume",
        str(checkpoint),
        "--world-size",
        "1",
        "--batch-size",
        "32",
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert code == 1
    assert err.strip() == (
        f"error: --resume {checkpoint}: taken 2 steps into epoch 2 by 2 ranks x batch 32; this run has 1 x 32, "
        f"which would read other samples: resume it with the same ranks and batch size, or from an epoch-end checkpoint"
    )


def test_job_record_keeps_the_newest_checkpoint_and_a_fatal_error_in_the_agent_store(monkeypatch):
    from src.ddp.job import JobRecord

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    nowhere = JobRecord.from_environment()  # no elastic agent: nothing recorded, nothing found
    nowhere.checkpoint_written("checkpoints/checkpoint_000004.pt")
    assert (nowhere.store, nowhere.newest_checkpoint(), nowhere.fatal_error()) == (None, None, None)

    agent_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    first_attempt, restarted = JobRecord.from_environment(), JobRecord.from_environment()
    assert restarted.newest_checkpoint() is None and restarted.fatal_error() is None
    first_attempt.checkpoint_written("checkpoints/checkpoint_000004.pt")
    first_attempt.checkpoint_written("checkpoints/checkpoint_000008.pt")
    first_attempt.record_fatal("dataset 'mnist' not found")
    assert restarted.newest_checkpoint() == "checkpoints/checkpoint_000008.pt"
    assert restarted.fatal_error() == "dataset 'mnist' not found"


def test_world_size_flag_must_agree_with_torchrun(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    code, err = _main(capsys, "--world-size", "3", "--log-dir", str(tmp_path / "logs"))
    assert code == 1
    assert err.strip() == "error: --world-size 3 disagrees with torchrun's WORLD_SIZE=2"
