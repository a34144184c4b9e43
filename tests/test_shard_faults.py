"""A sharded parameter server survives a shard SIGKILLed from outside mid-run, and a killed worker, on real processes.

The run is the runner's own command (`run_parameter_server_training.py --servers 2`, a local job: shard 0, one
follower shard and three workers as processes of the launcher). The test finds the follower's pid in its events
and SIGKILLs it once it has passed version 60; worker 1 kills itself at its step 10 (an injected fault). Then
every assertion reads what the run wrote: the shards start again together from the newest version all of them
have checkpointed, the versions past it are voided on every shard and redone, every shard ends with the same
history of versions, each made of the same pushes (``check_shards``), so every sample of every epoch is in
exactly one applied update on every shard (shard 0's coverage audit), and the model scores as the fault-free
run's.
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

from src.coordinator import check_coverage, check_shards
from src.metrics import read_events
from tests.ps_fixtures import RUNNER, kill_group, ps_config

pytestmark = [pytest.mark.alone, pytest.mark.slow, pytest.mark.timeout(600)]

NUM_TRAIN = 4000  # mnist_5k's training split
KILL_AFTER_VERSION = 60


def sharded_job(tmp_path: Path, name: str, faults: list[str] = (), **fields) -> Path:
    """3 workers, 2 shards (simple_cnn cut into 64 kB slices), 2 epochs of mnist_5k at batch 32: 84 versions, a
    checkpoint every 25. Written as a config file for the runner."""
    config = ps_config(
        tmp_path,
        name,
        system__num_workers=3,
        system__num_servers=2,
        system__shard_slice_bytes=64 << 10,
        system__aggregation_mode="sync",
        system__inject_faults=list(faults),
        system__heartbeat_interval=0.5,
        system__heartbeat_timeout=3.0,
        training__num_epochs=2,
        training__batch_size=32,
        training__max_train_samples=None,
        training__max_test_samples=None,
        training__momentum=0.9,
        training__checkpoint_interval=25,
        **fields,
    )
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config.to_dict()))
    return path


def start(config_file: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(RUNNER), "--config", str(config_file)],
        cwd=RUNNER.parent,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def events(log_dir: Path, role: str, kind: str | None = None) -> list[dict]:
    path = log_dir / role / "events.jsonl"
    return list(read_events(path, kind)) if path.is_file() else []


def wait_for(condition, timeout_s: float, what: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict:
    """The fault-free run's summary."""
    root = tmp_path_factory.mktemp("reference")
    reference = start(sharded_job(root, "reference"), root / "reference.out")
    assert reference.wait(timeout=300) == 0, (root / "reference.out").read_text()
    return json.loads((root / "reference" / "logs" / "summary.json").read_text())


def assert_recovered_together(logs: Path, summary: dict, expected: dict, dead: str) -> int:
    """The shards started again together once, from a common checkpoint, and ended as one model: returns the
    version they went back to."""
    restarted = events(logs, "launcher", "shards_restarted")
    assert len(restarted) == 1 and restarted[0]["shard"] == dead, restarted
    version = restarted[0]["version"]
    [recovered] = events(logs, "server", "server_recovered")
    assert recovered["version"] == version
    assert events(logs, "server_1", "shard_recovered")[-1]["version"] == version
    report = check_coverage(events(logs, "server"), NUM_TRAIN, 2)
    assert report["ok"], report
    assert report["voided"] == recovered["versions_lost"] > 0
    shards = check_shards(events(logs, "server"), {1: events(logs, "server_1")})
    assert shards["ok"] and shards["versions"] == summary["versions"], shards  # every version, of the same pushes
    assert summary["samples_processed"] == 2 * NUM_TRAIN
    assert abs(summary["final_accuracy"] - expected["final_accuracy"]) <= 0.02, (summary, expected)
    return version


def test_shard_0_killed_by_its_fault_is_survived(tmp_path, expected):
    config_file = sharded_job(tmp_path, "faulty", ["kill:server@version=40"])
    logs = tmp_path / "faulty" / "logs"
    run = start(config_file, tmp_path / "faulty.out")
    try:
        assert run.wait(timeout=300) == 0, (tmp_path / "faulty.out").read_text()
    finally:
        kill_group(run)
    summary = json.loads((logs / "summary.json").read_text())
    assert assert_recovered_together(logs, summary, expected, "shard 0") == 25


def test_a_shard_killed_from_outside_and_a_killed_worker_are_survived(tmp_path, expected):
    config_file = sharded_job(tmp_path, "faulty", ["kill:worker=1@step=10"], emulation__step_delay_s=0.1)
    logs = tmp_path / "faulty" / "logs"
    run = start(config_file, tmp_path / "faulty.out")
    try:
        wait_for(lambda: events(logs, "server_1", "run_start"), 120, "the follower's start", run)
        pid = events(logs, "server_1", "run_start")[0]["pid"]
        wait_for(
            lambda: any(e["version"] >= KILL_AFTER_VERSION for e in events(logs, "server_1", "update")),
            240,
            f"the follower's version {KILL_AFTER_VERSION}",
            run,
        )
        os.kill(pid, signal.SIGKILL)
        assert run.wait(timeout=300) == 0, (tmp_path / "faulty.out").read_text()
    finally:
        kill_group(run)
    summary = json.loads((logs / "summary.json").read_text())

    version = assert_recovered_together(logs, summary, expected, "shard 1")
    assert version % 25 == 0 and KILL_AFTER_VERSION - 25 <= version <= KILL_AFTER_VERSION + 25, version
    assert {e["worker"] for e in events(logs, "launcher", "worker_restarted")} == {1}
