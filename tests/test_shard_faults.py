"""A sharded parameter server survives a shard SIGKILLed from outside mid-run, and a killed worker, on real processes.

The run is the runner's own command (`run_parameter_server_training.py --servers 2`, a local job: shard 0, one
follower shard and three workers as processes of the launcher). The test finds the follower's pid in its events
and SIGKILLs it once it has passed version 25; worker 1 kills itself at its step 10 (an injected fault). Then
every assertion reads what the run wrote: the shards start again together from the newest version all of them
have checkpointed, the versions past it are voided on every shard and redone, every shard ends with the same
history of versions, each made of the same pushes (``check_shards``), so every sample of every epoch is in
exactly one applied update on every shard (shard 0's coverage audit), and the model scores as the fault-free
run's. The sync run with the follower killed from outside streams its holds with pipelined replies (TCP): a round that
lost a worker, or a dead follower's, only voids provisional slices, so it ends as the unpipelined reference.
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_TRAIN = 2000  # of mnist_5k's training split
KILL_AFTER_VERSION = 25
INTERVAL = 10  # versions between checkpoints


def sharded_job(tmp_path: Path, name: str, faults: list[str] = (), **fields) -> Path:
    """3 workers, 2 shards (simple_cnn cut into 64 kB slices), 2 epochs of 2,000 mnist_5k images at batch 32: 42
    versions, a checkpoint every 10. Written as a config file for the runner."""
    values = dict(
        system__num_workers=3,
        system__num_servers=2,
        system__shard_slice_bytes=64 << 10,
        system__aggregation_mode="sync",
        system__inject_faults=list(faults),
        system__heartbeat_interval=0.5,
        system__heartbeat_timeout=3.0,
        training__num_epochs=2,
        training__batch_size=32,
        training__max_train_samples=NUM_TRAIN,
        training__max_test_samples=None,
        training__momentum=0.9,
        training__checkpoint_interval=INTERVAL,
    )
    config = ps_config(tmp_path, name, **{**values, **fields})
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


@pytest.fixture(scope="module")
def expected_async(tmp_path_factory) -> dict:
    """The fault-free async run's summary."""
    root = tmp_path_factory.mktemp("reference_async")
    reference = start(sharded_job(root, "reference", **ASYNC), root / "reference.out")
    assert reference.wait(timeout=300) == 0, (root / "reference.out").read_text()
    return json.loads((root / "reference" / "logs" / "summary.json").read_text())


ASYNC = dict(system__aggregation_mode="async", system__staleness_policy="soft")
ASYNC_ACCURACY = 0.08
"""An async run's interleaving of pushes differs from run to run (the reference's too), so its accuracy is compared
with a wider margin than sync's, whose every version is the same. A clean-clone CI run (2026-12-05) scored 0.85
against its reference's 0.90 with both shards consistent and coverage exact, so 0.05 was at the edge of two async
runs' spread; a model missing a shard's updates scores far lower, and consistency and coverage are checked exactly
above."""


def assert_recovered_together(logs: Path, summary: dict, expected: dict, dead: str, accuracy: float = 0.02) -> int:
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
    assert abs(summary["final_accuracy"] - expected["final_accuracy"]) <= accuracy, (summary, expected)
    return version


def test_shard_0_killed_by_its_fault_is_survived(tmp_path, expected):
    config_file = sharded_job(tmp_path, "faulty", ["kill:server@version=20"])
    logs = tmp_path / "faulty" / "logs"
    run = start(config_file, tmp_path / "faulty.out")
    try:
        assert run.wait(timeout=300) == 0, (tmp_path / "faulty.out").read_text()
    finally:
        kill_group(run)
    summary = json.loads((logs / "summary.json").read_text())
    # killed at version 20 before any reply of it: the follower never applied it, so both go back to 10
    assert assert_recovered_together(logs, summary, expected, "shard 0") == 10


PIPELINED = dict(system__transport="tcp", system__streaming=True, system__pipelined_replies=True)
"""Streamed holds with pipelined replies (TCP): every shard steps the holds' slices as they arrive and sends them back,
and each pull leaves out what its step confirmed; the same model as without them, so the fault-free reference holds."""


def test_a_shard_killed_from_outside_and_a_killed_worker_are_survived(tmp_path, expected):
    """With pipelined replies (see :data:`PIPELINED`): slices stepped for a round that then went on without a worker, or
    with other samples than guessed, are voided (their tensors travel in the replies), so the shards still end as the
    unpipelined reference's model; the other rounds are pipelined (in one run here: 691 slices confirmed, 38 voided)."""
    summary = kill_follower_and_worker(tmp_path, expected, emulation__step_delay_s=0.1, **PIPELINED)
    counts = summary["pipelined_replies"]
    assert counts["slices_confirmed"] > 0 and counts["tensors_omitted"] > 0, counts


def test_async_a_shard_killed_from_outside_and_a_killed_worker_are_survived(tmp_path, expected_async):
    """The same in async (each push a version on every shard, in shard 0's order): every
    follower's history is shard 0's, and coverage stays exact on every shard."""
    kill_follower_and_worker(tmp_path, expected_async, accuracy=ASYNC_ACCURACY, emulation__step_delay_s=0.05, **ASYNC)


def kill_follower_and_worker(tmp_path: Path, expected: dict, accuracy: float = 0.02, **fields) -> dict:
    config_file = sharded_job(tmp_path, "faulty", ["kill:worker=1@step=10"], **fields)
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

    version = assert_recovered_together(logs, summary, expected, "shard 1", accuracy)
    assert version % INTERVAL == 0 and KILL_AFTER_VERSION - INTERVAL <= version <= KILL_AFTER_VERSION + INTERVAL
    assert {e["worker"] for e in events(logs, "launcher", "worker_restarted")} == {1}
    return summary


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def test_across_hosts_every_shard_started_again_with_resume_goes_back_together(tmp_path, expected):
    """The runner's roles by hand, as on several hosts (loopback, fixed ports): the follower is SIGKILLed past
    version 25; shard 0 notices within the heartbeat timeout and ends with an error (a supervisor would start it
    again); both are started again with `--resume` and the run's checkpoint folder; shard 0 asks the follower
    which versions it has, both go back to the newest they share, the workers register again, and the run ends
    as the fault-free one does."""
    config_file = sharded_job(tmp_path, "hosts", emulation__step_delay_s=0.05)
    ports = _free_ports(2)
    addresses = ",".join(f"127.0.0.1:{port}" for port in ports)
    logs, checkpoints = tmp_path / "hosts" / "logs", tmp_path / "hosts" / "ckpt"
    env = {**os.environ, "DTS_AUTH_TOKEN": "hosts-test-token-0123456789"}

    def role(name: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(RUNNER), "--config", str(config_file), "--shard-addresses", addresses, *args],
            cwd=RUNNER.parent,
            env=env,
            stdout=open(tmp_path / f"{name}.out", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    processes = {"follower": role("follower", "--role", "server", "--shard", "1")}
    processes["shard_0"] = role("shard_0", "--role", "server")
    for k in range(3):
        processes[f"worker_{k}"] = role(f"worker_{k}", "--role", "worker", "--worker-id", str(k))
    try:
        wait_for(
            lambda: any(e["version"] >= KILL_AFTER_VERSION for e in events(logs, "server_1", "update")),
            240,
            f"the follower's version {KILL_AFTER_VERSION}",
            processes["shard_0"],
        )
        processes["follower"].kill()
        assert processes["shard_0"].wait(timeout=60) == 1  # it noticed, and ends for its supervisor to restart it
        assert "shard 1 has not answered" in (tmp_path / "shard_0.out").read_text()
        processes["follower"] = role("follower_again", "--role", "server", "--shard", "1", "--resume", str(checkpoints))
        processes["shard_0"] = role("shard_0_again", "--role", "server", "--resume", str(checkpoints))
        outputs = {"follower": "follower_again", "shard_0": "shard_0_again"}
        for name, process in processes.items():
            output = (tmp_path / f"{outputs.get(name, name)}.out").read_text()
            assert process.wait(timeout=300) == 0, (name, output[-2000:])
    finally:
        for process in processes.values():
            kill_group(process)
    summary = json.loads((logs / "summary.json").read_text())
    [recovered] = events(logs, "server", "server_recovered")
    version = recovered["version"]
    assert version % INTERVAL == 0 and KILL_AFTER_VERSION - INTERVAL <= version <= KILL_AFTER_VERSION + INTERVAL
    assert events(logs, "server_1", "shard_recovered")[-1]["version"] == recovered["version"]
    report = check_coverage(events(logs, "server"), NUM_TRAIN, 2)
    assert report["ok"] and report["voided"] == recovered["versions_lost"], report
    shards = check_shards(events(logs, "server"), {1: events(logs, "server_1")})
    assert shards["ok"] and shards["versions"] == summary["versions"], shards
    assert summary["samples_processed"] == 2 * NUM_TRAIN
    assert abs(summary["final_accuracy"] - expected["final_accuracy"]) <= 0.02, (summary, expected)
