"""A hung DDP rank, for real: SIGSTOPped from outside by pid, detected, and the job finishes exactly.

The run is test_ddp_cli's fault run (2 ranks, top-k + error feedback, 16 steps, a checkpoint every
3 steps) with every step stretched by an emulated 0.1 s (``emulation.step_delay_s``, the PS
workers' ``netem.ComputeDelay``), so the test can stop a rank mid-run:

* a slow but alive rank (rank 1 four times slower: ``slowdown: 4`` and 0.4 s a step, each step
  longer than the heartbeat interval) is never declared hung; that run is also the reference;
* rank 1 SIGSTOPped under the local launcher, rank 0 (the checkpoint writer) under torchrun: the
  other rank reports ``rank_hung`` within ``--collective-timeout`` + 5 s of the SIGSTOP, kills the
  stopped process, the agent restarts the group once from its newest checkpoint, and the final
  parameters and momentum are bitwise those of the reference run.
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
import yaml
from torch.distributed import TCPStore

from src.metrics import read_events
from tests.ddp_fixtures import process_gone, torchrun_command
from tests.python_command import ForkedPopen, forkable
from tests.test_ddp_cli import RUN_ARGS, RUN_TIMEOUT_S, RUNNER, _assert_same_training, _clean_env

pytestmark = [pytest.mark.alone, pytest.mark.slow, pytest.mark.timeout(300)]

HANG_TIMEOUT_S = 5.0
DETECTION_SLACK_S = 5.0
STEP_DELAY = {"step_delay_s": 0.1}


def _start(command: list[str], cwd: Path, emulation: dict) -> subprocess.Popen | ForkedPopen:
    (cwd / "emulation.yaml").write_text(yaml.safe_dump({"emulation": emulation}))
    argv, env = [*command, "--config", "emulation.yaml"], _clean_env()
    if forkable(argv, env):
        return ForkedPopen(argv, cwd=cwd, env=env, stdout=cwd / "out.txt", stderr=cwd / "err.txt")
    with open(cwd / "out.txt", "w") as out, open(cwd / "err.txt", "w") as err:
        return subprocess.Popen(
            [*command, "--config", "emulation.yaml"],
            cwd=cwd,
            env=_clean_env(),
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def _finish(process: subprocess.Popen, cwd: Path) -> tuple[int, str, str]:
    try:
        process.wait(RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, (cwd / "out.txt").read_text(), (cwd / "err.txt").read_text()


def _runner(*args: str) -> list[str]:
    return [sys.executable, RUNNER, *RUN_ARGS, *args]


def _logs(cwd: Path) -> Path:
    return cwd / "logs" / "ddp_cli"


def _final(cwd: Path) -> dict:
    return torch.load(cwd / "checkpoints" / "ddp_cli" / "ddp_final.pt", weights_only=True)


def _hung_events(cwd: Path) -> list[dict]:
    return [
        event for rank in range(2) for event in read_events(_logs(cwd) / f"rank_{rank}" / "events.jsonl", "rank_hung")
    ]


@pytest.fixture(scope="module")
def slow_rank_run(tmp_path_factory) -> Path:
    """Rank 1 four times slower than rank 0, with a 3 s timeout: must finish untouched (the reference)."""
    cwd = tmp_path_factory.mktemp("slow_rank")
    emulation = {**STEP_DELAY, "workers": {1: {"slowdown": 4, "step_delay_s": 0.4}}}
    code, out, err = _finish(_start(_runner("--world-size", "2", "--collective-timeout", "3"), cwd, emulation), cwd)
    assert code == 0, err[-3000:]
    return cwd


def test_a_slow_but_alive_rank_is_never_declared_hung(slow_rank_run):
    summary = json.loads((_logs(slow_rank_run) / "summary.json").read_text())
    assert (summary["restarts"], summary["steps"], summary["collective_timeout_s"]) == (0, 16, 3.0)
    assert _hung_events(slow_rank_run) == []
    fast, slow = (json.loads((_logs(slow_rank_run) / f"ddp_rank_{rank}.json").read_text()) for rank in range(2))
    # every one of rank 1's steps waited 0.4 s and more: longer than a heartbeat interval (0.3 s)
    assert slow["emulated_delay_s"] >= 16 * 0.4 and fast["emulated_delay_s"] == pytest.approx(16 * 0.1, rel=1e-6)
    assert slow["emulated_delay_s"] >= 4 * fast["emulated_delay_s"]


def _stop_rank_mid_run(process: subprocess.Popen, cwd: Path, rank: int) -> tuple[int, float]:
    """SIGSTOP ``rank`` (by pid, from here) once the step-6 checkpoint is written; returns (pid, when).

    Written means logged: rank 0 logs its ``checkpoint`` event after the job's store names the file as
    the newest (what a restart resumes from); the file alone shows up a moment before that."""
    events = _logs(cwd) / f"rank_{rank}" / "events.jsonl"
    run_events = _logs(cwd) / "events.jsonl"

    def step_6_checkpoint_logged() -> bool:
        return run_events.exists() and any(e["step"] == 6 for e in read_events(run_events, "checkpoint"))

    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (step_6_checkpoint_logged() and events.exists() and any(True for _ in read_events(events, "run_start"))):
        assert process.poll() is None, (cwd / "err.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never reached its step-6 checkpoint"
        time.sleep(0.02)  # polling interval of the condition above
    pid = next(read_events(events, "run_start"))["pid"]
    os.kill(pid, signal.SIGSTOP)
    return pid, time.time()


def _assert_detected_and_resumed(cwd: Path, stopped_rank: int, pid: int, stopped_at: float, reference: Path) -> None:
    (hung,) = _hung_events(cwd)  # one detector: the other rank
    assert (hung["hung_rank"], hung["by_rank"], hung["pid"], hung["killed"]) == (
        stopped_rank,
        1 - stopped_rank,
        pid,
        True,
    )
    latency = hung["time"] - stopped_at
    print(
        f"rank {stopped_rank} SIGSTOPped: rank_hung after {latency:.2f}s ({hung['detected_by']}), "
        f"timeout {HANG_TIMEOUT_S:g}s"
    )
    assert latency <= HANG_TIMEOUT_S + DETECTION_SLACK_S
    assert process_gone(pid)
    restarts = list(read_events(_logs(cwd) / "events.jsonl", "rank_restarted"))
    assert [event["attempt"] for event in restarts] == [1] and restarts[0]["step"] >= 6
    assert json.loads((_logs(cwd) / "summary.json").read_text())["restarts"] == 1
    _assert_same_training(_final(cwd), _final(reference))


def _kill_if_left(pid: int | None) -> None:
    if pid is not None and not process_gone(pid):
        os.kill(pid, signal.SIGKILL)


def test_a_sigstopped_rank_is_detected_and_the_group_resumes_exactly(tmp_path, slow_rank_run):
    process = _start(_runner("--world-size", "2", "--collective-timeout", str(HANG_TIMEOUT_S)), tmp_path, STEP_DELAY)
    pid = None
    try:
        pid, stopped_at = _stop_rank_mid_run(process, tmp_path, rank=1)
        code, out, err = _finish(process, tmp_path)
    finally:
        _kill_if_left(pid)
        _finish(process, tmp_path)
    assert code == 0, err[-3000:]
    assert "restart 1/3: the group continues from" in err  # a log line (src/telemetry/logs.py), as in test_ddp_cli
    assert f"rank 0: rank 1 (pid {pid} on" in err and "hung; killed it" in err
    _assert_detected_and_resumed(tmp_path, 1, pid, stopped_at, slow_rank_run)


def test_a_sigstopped_rank_is_detected_under_torchrun_and_restarted_by_it(tmp_path, slow_rank_run):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torchrun = [*torchrun_command(store.port, nproc=2), "--max-restarts", "1"]
    process = _start([*torchrun, *_runner("--collective-timeout", str(HANG_TIMEOUT_S))[1:]], tmp_path, STEP_DELAY)
    pid = None
    try:
        pid, stopped_at = _stop_rank_mid_run(process, tmp_path, rank=0)  # the rank that writes checkpoints
        code, out, err = _finish(process, tmp_path)
    finally:
        _kill_if_left(pid)
        _finish(process, tmp_path)
    assert code == 0, err[-3000:]
    _assert_detected_and_resumed(tmp_path, 0, pid, stopped_at, slow_rank_run)
