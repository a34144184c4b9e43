"""deploy/slurm/ps.sbatch and ddp.sbatch submitted with sbatch to a real one-node Slurm cluster.

The cluster (:mod:`tests.slurm_fixtures`: munged, slurmctld, slurmd) is started once for the module.
Each job trains mnist_5k briefly; the tests wait for Slurm to report it finished and then read what
it wrote: the job's output, the run summary, the events and the final checkpoint (evaluated here).
Faults are Slurm's own: ``scancel --signal=KILL`` on a worker's step, ``scontrol requeue`` of a DDP
job with a checkpoint written. The two tests without a cluster check the scripts' refusals.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.coordinator import check_coverage
from src.metrics import read_events
from tests.ps_fixtures import ROOT
from tests.slurm_fixtures import FINISHED_STATES, SlurmCluster, skip_or_fail, slurm_unavailable

pytestmark = pytest.mark.cluster

PS_SCRIPT = ROOT / "deploy" / "slurm" / "ps.sbatch"
DDP_SCRIPT = ROOT / "deploy" / "slurm" / "ddp.sbatch"
NUM_TRAIN = 4000  # mnist_5k's training split
NUM_TEST = 500
# 1 epoch, sync, 2 workers x batch 32: 63 versions; heartbeats fast enough that a killed worker is
# failed 3 s after its last one.
PS_FLAGS = [
    *"--dataset mnist_5k --num-epochs 1 --batch-size 32 --max-test-samples".split(),
    str(NUM_TEST),
    *"--heartbeat-interval 0.5 --heartbeat-timeout 3 --checkpoint-interval 20".split(),
]
# 2 epochs, 2 ranks x batch 16: 250 steps, a checkpoint every 4 (a requeue lands long before the end).
# The 2-shard jobs: PS_FLAGS with tensors cut across the shards by 64 kB slices.
SHARDED_FLAGS = [*PS_FLAGS, "--set", "system.shard_slice_bytes=65536"]
DDP_FLAGS = [
    *"--dataset mnist_5k --num-epochs 2 --batch-size 16 --max-test-samples".split(),
    str(NUM_TEST),
    "--checkpoint-interval-steps",
    "4",
]
DDP_STEPS = 2 * NUM_TRAIN // 32
JOB_TIMEOUT_S = 240
CREDENTIAL_REVOCATION_S = 2.0  # a requeued job's credential must be a whole second newer than the revoked one


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_unavailable()
    if reason is not None:
        skip_or_fail(reason)
    cluster = SlurmCluster()
    try:
        cluster.start()
    except Exception as exc:  # noqa: BLE001 - any failure to come up is the reason to report
        cluster.stop()
        skip_or_fail(f"the one-node cluster did not start: {exc}")
    yield cluster
    cluster.stop()


def submit(
    cluster: SlurmCluster, script: Path, flags: list[str], workdir: Path, *options: str, env: dict | None = None
) -> int:
    """Submit ``script`` with this checkout and this Python (and ``env``, e.g. DTS_SERVERS); outputs under
    ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"DTS_REPO": str(ROOT), "DTS_PYTHON": sys.executable, "PYTHONPATH": os.environ.get("PYTHONPATH", "")} | (
        env or {}
    )
    return cluster.submit(script, flags, workdir=workdir, env=env, options=options)


def output(workdir: Path, job_id: int) -> str:
    path = workdir / f"slurm-{job_id}.out"
    return path.read_text() if path.is_file() else "(no output)"


def finished_ok(cluster: SlurmCluster, job_id: int, workdir: Path) -> dict[str, str]:
    """Wait for the job; assert it completed with status 0 and left no process behind."""
    try:
        job = cluster.wait_for_job(job_id, JOB_TIMEOUT_S)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{output(workdir, job_id)}\n{cluster.diagnostics()}")
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), (
        f"{job}\n{output(workdir, job_id)}\n{cluster.diagnostics()}"
    )
    assert cluster.job_processes(job_id) == [], "processes of the finished job are still running"
    return job


def checkpoint_accuracy(path: Path, capsys) -> float:
    """scripts/evaluate_checkpoint.py on the run's test subset, in this process (torch is loaded already)."""
    spec = importlib.util.spec_from_file_location("evaluate_checkpoint", ROOT / "scripts" / "evaluate_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    assert module.main(["--checkpoint", str(path), "--max-test-samples", str(NUM_TEST)]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["accuracy"]


def assert_final_checkpoint(summary: dict, workdir: Path, capsys, *, at_least: float) -> None:
    """The summary's checkpoint scores the summary's accuracy (within one test sample), and that is sane."""
    path = workdir / summary["checkpoint_path"]
    assert path.is_file(), f"no final checkpoint at {path}"
    assert abs(checkpoint_accuracy(path, capsys) - summary["final_accuracy"]) <= 1 / NUM_TEST + 1e-9
    assert summary["final_accuracy"] >= at_least, summary["final_accuracy"]


def assert_ps_roles_ended(text: str, statuses: dict[str, str]) -> None:
    for role, status in statuses.items():
        lines = [line for line in text.splitlines() if line.startswith(f"ps.sbatch: {role} ended with status ")]
        assert len(lines) == 1, f"{role}: {lines}\n{text}"
        found = lines[0].rsplit(" ", 1)[1]
        assert (found != "0") if status == "nonzero" else (found == status), f"{lines[0]}\n{text}"


def requeue_once_checkpointed(
    cluster: SlurmCluster, job_id: int, checkpoints: Path, workdir: Path, ready: Callable[[], bool] | None = None
) -> None:
    """``scontrol requeue`` the running job once it has written a numbered checkpoint (or once ``ready()``); start
    it again 2 s later."""
    ready = ready or (lambda: any(checkpoints.glob("checkpoint_*.pt")))
    job = cluster.wait_for_job(
        job_id, JOB_TIMEOUT_S, until=lambda job: job["JobState"] not in ("PENDING", "RUNNING") or ready()
    )
    assert job["JobState"] == "RUNNING", f"the job ended before its checkpoint: {job}\n{output(workdir, job_id)}"
    cluster.run("scontrol", "requeue", str(job_id))
    # Slurm makes a requeued job eligible only 2 minutes later (its EligibleTime); the test starts it
    # 2 s after it is back in the queue. Not sooner: slurmd refuses a launch whose credential is from
    # the same second as the killed execution's revoked one ("Job credential revoked": the job
    # fails). And not with StartTime=now+2: a job that becomes eligible by the clock waits for the
    # scheduler's next periodic pass (up to a minute), one updated to StartTime=now is scheduled at once.
    job = cluster.wait_for_job(
        job_id, JOB_TIMEOUT_S, until=lambda job: job["JobState"] in ("PENDING", *FINISHED_STATES)
    )
    assert (job["JobState"], job["Restarts"]) == ("PENDING", "1"), f"{job}\n{output(workdir, job_id)}"
    time.sleep(CREDENTIAL_REVOCATION_S)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    assert "DUE TO JOB REQUEUE" in output(workdir, job_id)


# ----------------------------------------------------------------------------- parameter server


@pytest.fixture(scope="module")
def two_shards_uninterrupted(slurm, tmp_path_factory):
    """One 2-shard ps.sbatch job run to the end without a fault: the reference for the faulted ones."""
    workdir = tmp_path_factory.mktemp("two_shards_uninterrupted")
    job_id = submit(slurm, PS_SCRIPT, SHARDED_FLAGS, workdir, "--ntasks=4", "--overcommit", env={"DTS_SERVERS": "2"})
    finished_ok(slurm, job_id, workdir)
    summary = json.loads((workdir / "logs" / f"slurm_ps_{job_id}" / "summary.json").read_text())
    return job_id, workdir, summary


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 90)
def test_ps_job_with_two_server_shards_trains_to_completion(slurm, two_shards_uninterrupted, capsys):
    """DTS_SERVERS=2 and 4 tasks: shard 0 on task 0, shard 1 on task 1 (its own step, port + 1), the workers on
    tasks 2 and 3 with both shards' addresses. Every step ends with 0 by itself (shard 1 once shard 0 has ended
    the run) and the final checkpoint is the whole model, cut across the shards by 64 kB slices."""
    from src.config import config_from_data
    from src.trainer import model_from_config

    job_id, tmp_path, summary = two_shards_uninterrupted
    text = output(tmp_path, job_id)
    assert_ps_roles_ended(text, {"parameter server": "0", "server shard 1": "0", "worker 0": "0", "worker 1": "0"})
    port = 20000 + job_id % 10000  # shard k on port + k
    assert f"2 server shards on {slurm.node}:{port},{slurm.node}:{port + 1} (shard 0 first), 2 workers" in text, text
    assert "parameter-server shard 1: the run is over; its part of the model is in" in text, text
    assert "starting it again" not in text, text
    log_dir = tmp_path / "logs" / f"slurm_ps_{job_id}"
    assert (summary["num_workers"], summary["samples_processed"]) == (2, NUM_TRAIN)
    assert sorted(w["worker_id"] for w in summary["workers"] if w["final"]) == [0, 1]
    placement = summary["placement"]
    assert placement["num_shards"] == 2 and all(placement["slices_per_shard"]), placement
    assert any("#" in key for shard in placement["slices_per_shard"] for key in shard), "no tensor was cut"
    assert (log_dir / "server_1" / "events.jsonl").is_file()
    assert summary["checkpoint_path"] == f"checkpoints/slurm_ps_{job_id}/parameter_server_final.pt"
    checkpoint = load_checkpoint(tmp_path / summary["checkpoint_path"])
    model = model_from_config(config_from_data(checkpoint["config"]))
    assert list(checkpoint["model_state_dict"]) == list(model.state_dict()), "not the whole model"
    assert (checkpoint["extra"]["num_servers"], checkpoint["extra"]["version"]) == (2, summary["versions"])
    assert_final_checkpoint(summary, tmp_path, capsys, at_least=0.85)


def follower_version(log_dir: Path) -> int:
    """The newest version shard 1 has applied (its events), 0 before any."""
    path = log_dir / "server_1" / "events.jsonl"
    return max((e["version"] for e in read_events(path, "update")), default=0) if path.is_file() else 0


def assert_shards_went_back_together(
    log_dir: Path, reference: dict, workdir: Path, capsys, *, versions: tuple[int, ...]
) -> None:
    """Shard 0 resumed from one of ``versions`` (checkpointed by both shards), shard 1 went back to the same; every
    sample once in shard 0's applied updates, every version of shard 1 made of shard 0's pushes, and the whole
    model scores within 0.02 of the fault-free job (``reference``: its summary)."""
    from src.coordinator import check_shards

    events = list(read_events(log_dir / "server" / "events.jsonl"))
    recoveries = [e for e in events if e["kind"] == "server_recovered"]
    assert recoveries and recoveries[-1]["version"] in versions, recoveries
    follower = list(read_events(log_dir / "server_1" / "events.jsonl"))
    assert [e["version"] for e in follower if e["kind"] == "shard_recovered"][-1:] == [recoveries[-1]["version"]]
    coverage = check_coverage(events, NUM_TRAIN, 1)
    assert coverage["ok"] and coverage["voided"] == sum(e["versions_lost"] for e in recoveries), coverage
    summary = json.loads((log_dir / "summary.json").read_text())
    shards = check_shards(events, {1: follower})
    assert shards["ok"] and shards["versions"] == summary["versions"] == reference["versions"], shards
    assert summary["samples_processed"] == NUM_TRAIN
    assert abs(summary["final_accuracy"] - reference["final_accuracy"]) <= 0.02, (summary, reference)
    assert_final_checkpoint(summary, workdir, capsys, at_least=0.85)


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 90)  # + the fault-free job when this test runs first
def test_ps_job_with_two_server_shards_brings_back_a_shard_process_killed_mid_run(
    slurm, two_shards_uninterrupted, tmp_path, capsys
):
    """Shard 1's process SIGKILLed from outside past version 25 (checkpoints every 20): its step's loop in the
    script starts it again with --resume-unfinished; shard 0 sees it go and exits 1, and its loop starts it again
    too; both go back to version 20 (or 40), the workers register again, and the job completes with every
    sample once, the shards consistent and the accuracy of the fault-free job."""
    job_id = submit(slurm, PS_SCRIPT, SHARDED_FLAGS, tmp_path, "--ntasks=4", "--overcommit", env={"DTS_SERVERS": "2"})
    log_dir = tmp_path / "logs" / f"slurm_ps_{job_id}"
    job = slurm.wait_for_job(
        job_id,
        JOB_TIMEOUT_S,
        until=lambda job: job["JobState"] not in ("PENDING", "RUNNING") or follower_version(log_dir) >= 25,
    )
    steps = slurm.steps(job_id)
    assert job["JobState"] == "RUNNING" and "ps-server-1" in steps, f"{job}, {steps}\n{output(tmp_path, job_id)}"
    (follower_pid,) = slurm.step_pids(steps["ps-server-1"])
    os.kill(follower_pid, signal.SIGKILL)
    finished_ok(slurm, job_id, tmp_path)

    text = output(tmp_path, job_id)
    assert_ps_roles_ended(text, {"parameter server": "0", "server shard 1": "0", "worker 0": "0", "worker 1": "0"})
    for role in ("server shard 1", "parameter server"):  # shard 1 killed, shard 0 ended by its watch
        assert f"ps.sbatch: {role} exited with status " in text and "(restart 1 of 3) with --resume-unfinished" in text
    assert "ps.sbatch: server shard 1 exited with status 137 before the run was over" in text, text
    assert "restart 2 of 3" not in text, text
    _, _, reference = two_shards_uninterrupted
    assert_shards_went_back_together(log_dir, reference, tmp_path, capsys, versions=(20, 40))


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT_S + 90)
def test_ps_job_with_two_server_shards_requeued_mid_run_resumes_from_their_checkpoints(
    slurm, two_shards_uninterrupted, tmp_path, capsys
):
    """A 2-shard job requeued past version 25: the second execution starts every shard with --resume-unfinished,
    and the run goes on from the shards' newest common checkpoint (20 or 40), not afresh."""
    job_id = submit(slurm, PS_SCRIPT, SHARDED_FLAGS, tmp_path, "--ntasks=4", "--overcommit", env={"DTS_SERVERS": "2"})
    log_dir = tmp_path / "logs" / f"slurm_ps_{job_id}"
    checkpoints = tmp_path / "checkpoints" / f"slurm_ps_{job_id}"
    requeue_once_checkpointed(slurm, job_id, checkpoints, tmp_path, ready=lambda: follower_version(log_dir) >= 25)
    finished_ok(slurm, job_id, tmp_path)

    text = output(tmp_path, job_id)
    assert f"ps.sbatch: job {job_id} (restart 1): 2 server shards" in text, text
    assert "resuming the interrupted run from" in text and "shard 1: starting again" in text, text
    _, _, reference = two_shards_uninterrupted
    assert_shards_went_back_together(log_dir, reference, tmp_path, capsys, versions=(20, 40))


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 90)
def test_ps_job_with_two_server_shards_and_no_restarts_left_stops_when_a_shard_step_is_killed(slurm, tmp_path):
    """DTS_SHARD_RESTARTS=0: shard 1's step killed mid-run (scancel --signal=KILL) is not started again; every
    other step is stopped at once and the job fails with one line naming the shard; nothing is left running."""
    job_id = submit(
        slurm,
        PS_SCRIPT,
        PS_FLAGS,
        tmp_path,
        "--ntasks=4",
        "--overcommit",
        env={"DTS_SERVERS": "2", "DTS_SHARD_RESTARTS": "0"},
    )
    server_events = tmp_path / "logs" / f"slurm_ps_{job_id}" / "server" / "events.jsonl"
    job = slurm.wait_for_job(job_id, JOB_TIMEOUT_S, until=_training(server_events))
    steps = slurm.steps(job_id)
    assert job["JobState"] == "RUNNING" and {"ps-server", "ps-server-1", "ps-worker-0"} <= steps.keys(), (
        f"{job['JobState']}, steps {steps}\n{output(tmp_path, job_id)}"
    )
    slurm.run("scancel", "--signal=KILL", steps["ps-server-1"])
    try:
        job = slurm.wait_for_job(job_id, JOB_TIMEOUT_S)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{output(tmp_path, job_id)}")
    text = output(tmp_path, job_id)
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "1:0"), f"{job}\n{text}"
    assert "0 restarts per shard" in text and "starting it again" not in text, text
    assert_ps_roles_ended(text, {"server shard 1": "nonzero"})
    assert "ps.sbatch: server shard 1 ended before the run was over and was not started again: stopping the job" in text
    assert not (tmp_path / "checkpoints" / f"slurm_ps_{job_id}" / "parameter_server_final.pt").exists()
    deadline = time.monotonic() + 30
    while slurm.job_processes(job_id):
        assert time.monotonic() < deadline, f"processes of the stopped job still run\n{text}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 90)
def test_ps_job_with_two_server_shards_cancelled_mid_run_stops_every_step(slurm, tmp_path):
    """scancel of a 2-shard job mid-run: every step stops and none is started again; nothing is left running."""
    job_id = submit(slurm, PS_SCRIPT, PS_FLAGS, tmp_path, "--ntasks=4", "--overcommit", env={"DTS_SERVERS": "2"})
    server_events = tmp_path / "logs" / f"slurm_ps_{job_id}" / "server" / "events.jsonl"
    job = slurm.wait_for_job(job_id, JOB_TIMEOUT_S, until=_training(server_events))
    assert job["JobState"] == "RUNNING", f"{job}\n{output(tmp_path, job_id)}"
    slurm.run("scancel", str(job_id))
    job = slurm.wait_for_job(job_id, JOB_TIMEOUT_S)
    assert job["JobState"] == "CANCELLED", f"{job}\n{output(tmp_path, job_id)}"
    deadline = time.monotonic() + 30  # Slurm's KillWait (10 s) and the processes' own ends
    while slurm.job_processes(job_id):
        assert time.monotonic() < deadline, f"processes of the cancelled job still run\n{output(tmp_path, job_id)}"
        time.sleep(0.2)
    text = output(tmp_path, job_id)
    assert "starting it again" not in text, text
    assert not (tmp_path / "checkpoints" / f"slurm_ps_{job_id}" / "parameter_server_final.pt").exists()


def _training(server_events) -> Callable[[dict[str, str]], bool]:
    """When to act on a PS job: a few updates applied while it runs (or the job over: the assertion says)."""

    def training(job: dict[str, str]) -> bool:
        if job["JobState"] != "RUNNING":
            return job["JobState"] != "PENDING"
        return server_events.is_file() and sum(1 for _ in read_events(server_events, "update")) >= 5

    return training


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 90)
def test_ps_job_survives_a_worker_step_killed_by_scancel(slurm, tmp_path, capsys):
    job_id = submit(slurm, PS_SCRIPT, PS_FLAGS, tmp_path, "--overcommit")
    server_events = tmp_path / "logs" / f"slurm_ps_{job_id}" / "server" / "events.jsonl"

    job = slurm.wait_for_job(job_id, JOB_TIMEOUT_S, until=_training(server_events))
    steps = slurm.steps(job_id)
    assert job["JobState"] == "RUNNING" and {"ps-server", "ps-worker-0", "ps-worker-1"} <= steps.keys(), (
        f"{job['JobState']}, steps {steps}\n{output(tmp_path, job_id)}"
    )
    # The token the job made for itself, as its server process holds it.
    (server_pid,) = slurm.step_pids(steps["ps-server"])
    environ = dict(
        entry.split(b"=", 1) for entry in Path(f"/proc/{server_pid}/environ").read_bytes().split(b"\0") if b"=" in entry
    )
    token = environ[b"DTS_AUTH_TOKEN"]
    assert len(token) == 48, "the job's auth token is 24 random bytes in hex"
    slurm.run("scancel", "--signal=KILL", steps["ps-worker-1"])

    finished_ok(slurm, job_id, tmp_path)
    text = output(tmp_path, job_id)
    assert_ps_roles_ended(text, {"parameter server": "0", "worker 0": "0", "worker 1": "nonzero"})
    events = list(read_events(server_events))
    assert any(e["kind"] == "worker_failed" and e["worker"] == 1 for e in events), "worker 1 was never failed"
    assert any(e["kind"] == "work_reassigned" for e in events), "worker 1's work was not reassigned"
    report = check_coverage(events, NUM_TRAIN, 1)
    assert report["ok"], report
    summary = json.loads((tmp_path / "logs" / f"slurm_ps_{job_id}" / "summary.json").read_text())
    assert summary["samples_processed"] == NUM_TRAIN
    assert_final_checkpoint(summary, tmp_path, capsys, at_least=0.8)
    # The token is in no file: not in the job's output, logs, summaries or checkpoints, nor in
    # anything Slurm keeps (state, spool, logs).
    for folder in (tmp_path, slurm.root):
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_socket():
                assert token not in path.read_bytes(), f"the auth token is in {path}"


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 90)  # + the cluster's start when this test runs first
def test_ps_job_requeued_mid_run_resumes_from_its_checkpoint(slurm, tmp_path, capsys):
    job_id = submit(slurm, PS_SCRIPT, PS_FLAGS, tmp_path, "--overcommit")
    requeue_once_checkpointed(slurm, job_id, tmp_path / "checkpoints" / f"slurm_ps_{job_id}", tmp_path)
    finished_ok(slurm, job_id, tmp_path)

    text = output(tmp_path, job_id)
    assert f"ps.sbatch: job {job_id} (restart 1)" in text and "resuming the interrupted run from" in text, text
    # The second execution trains to the end: every role ends with 0, the summary and the final checkpoint are
    # where the script says (this job is also the suite's fault-free end of a single-server job: one job fewer).
    second = text[text.index(f"ps.sbatch: job {job_id} (restart 1)") :]
    assert_ps_roles_ended(second, {"parameter server": "0", "worker 0": "0", "worker 1": "0"})
    server_events = tmp_path / "logs" / f"slurm_ps_{job_id}" / "server" / "events.jsonl"
    events = list(read_events(server_events))
    (recovered,) = [e for e in events if e["kind"] == "server_recovered"]
    assert recovered["version"] > 0, recovered
    # Updates after the checkpoint were lost with the first execution and redone: every sample once.
    report = check_coverage(events, NUM_TRAIN, 1)
    assert report["ok"], report
    summary = json.loads((tmp_path / "logs" / f"slurm_ps_{job_id}" / "summary.json").read_text())
    assert (summary["num_workers"], summary["samples_processed"]) == (2, NUM_TRAIN)
    assert sorted(w["worker_id"] for w in summary["workers"] if w["final"]) == [0, 1]
    assert summary["checkpoint_path"] == f"checkpoints/slurm_ps_{job_id}/parameter_server_final.pt"
    assert_final_checkpoint(summary, tmp_path, capsys, at_least=0.85)


# ----------------------------------------------------------------------------- DDP


@pytest.fixture(scope="module")
def ddp_uninterrupted(slurm, tmp_path_factory):
    """One ddp.sbatch job run to the end: the reference for the requeued job."""
    workdir = tmp_path_factory.mktemp("ddp_uninterrupted")
    job_id = submit(slurm, DDP_SCRIPT, DDP_FLAGS, workdir)
    finished_ok(slurm, job_id, workdir)
    summary = json.loads((workdir / "logs" / f"slurm_ddp_{job_id}" / "summary.json").read_text())
    return job_id, workdir, summary


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 90)
def test_ddp_job_trains_to_completion(ddp_uninterrupted, capsys):
    job_id, workdir, summary = ddp_uninterrupted
    assert "ddp.sbatch: job" in output(workdir, job_id)
    assert (summary["world_size"], summary["steps"], summary["resumed_from"]) == (2, DDP_STEPS, None)
    assert summary["checkpoint_path"] == f"checkpoints/slurm_ddp_{job_id}/ddp_final.pt"
    for rank in (0, 1):  # every rank ran to the end
        rank_summary = json.loads((workdir / "logs" / f"slurm_ddp_{job_id}" / f"ddp_rank_{rank}.json").read_text())
        assert rank_summary["steps"] == DDP_STEPS, rank_summary
    assert_final_checkpoint(summary, workdir, capsys, at_least=0.9)


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 90)
def test_ddp_job_requeued_mid_run_resumes_from_its_checkpoint(slurm, ddp_uninterrupted, tmp_path, capsys):
    job_id = submit(slurm, DDP_SCRIPT, DDP_FLAGS, tmp_path)
    checkpoints = tmp_path / "checkpoints" / f"slurm_ddp_{job_id}"
    requeue_once_checkpointed(slurm, job_id, checkpoints, tmp_path)
    finished_ok(slurm, job_id, tmp_path)

    text = output(tmp_path, job_id)
    assert f"ddp.sbatch: job {job_id} (restart 1)" in text and "resuming from its newest checkpoint" in text, text
    log_dir = tmp_path / "logs" / f"slurm_ddp_{job_id}"
    summary = json.loads((log_dir / "summary.json").read_text())
    events = list(read_events(log_dir / "events.jsonl"))
    starts = [i for i, e in enumerate(events) if e["kind"] == "run_start"]
    assert [events[i]["resumed_from"] for i in starts] == [None, summary["resumed_from"]], [events[i] for i in starts]
    # The second execution took the newest checkpoint the first one wrote, and that was mid-run.
    (newest,) = [e for e in events[: starts[1]] if e["kind"] == "checkpoint"][-1:]
    assert summary["resumed_from"] == newest["path"], (summary["resumed_from"], newest)
    assert 0 < newest["step"] < DDP_STEPS and not any(e["kind"] == "run_end" for e in events[: starts[1]])
    assert (summary["steps"], summary["steps_this_run"]) == (DDP_STEPS, DDP_STEPS - newest["step"])
    # Resumed exactly where it left off: the same parameters as the uninterrupted job.
    _, reference_dir, reference = ddp_uninterrupted
    ours = load_checkpoint(tmp_path / summary["checkpoint_path"])["model_state_dict"]
    theirs = load_checkpoint(reference_dir / reference["checkpoint_path"])["model_state_dict"]
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=f"{name} differs from the uninterrupted job")
    assert summary["final_accuracy"] == reference["final_accuracy"]
    assert_final_checkpoint(summary, tmp_path, capsys, at_least=0.9)


# ----------------------------------------------------------------------------- the scripts' checks


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "nodes, tasks_per_node, expected",
    [
        ("n1", "3", ["n1"] * 3),
        ("n[1-3]", "2(x2),1", ["n1", "n1", "n2", "n2", "n3"]),
        ("a,b[7-8]", "1,2,1", ["a", "b7", "b7", "b8"]),
    ],
)
def test_tasks_are_placed_on_their_nodes_in_slurm_block_layout(slurm, nodes, tasks_per_node, expected):
    """ps.sbatch runs task t (0: the server, k + 1: worker k) on the node Slurm gave task t."""
    found = subprocess.run(
        ["bash", "-c", f"source {ROOT}/deploy/slurm/common.sh && slurm_task_nodes"],
        capture_output=True,
        text=True,
        timeout=30,
        env=slurm.env | {"SLURM_JOB_NODELIST": nodes, "SLURM_TASKS_PER_NODE": tasks_per_node},
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == expected


@pytest.mark.parametrize("script", [PS_SCRIPT, DDP_SCRIPT], ids=["ps", "ddp"])
def test_scripts_outside_slurm_fail_with_one_line(script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"{script.name}: SLURM_JOB_ID is not set: this script runs inside a Slurm job (submit it with sbatch)"
    ]


@pytest.mark.parametrize(
    "script, flag",
    [
        (PS_SCRIPT, "--workers"),
        (PS_SCRIPT, "--resume"),
        (PS_SCRIPT, "--servers"),
        (PS_SCRIPT, "--shard-addresses"),
        (DDP_SCRIPT, "--world-size"),
        (DDP_SCRIPT, "--log-dir"),
    ],
)
def test_scripts_refuse_the_flags_they_set(script, flag):
    result = run_outside_slurm(script, ["--", "--dataset", "mnist_5k", f"{flag}=2"])
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{script.name}: {flag} is set by this script ("), line


def run_outside_slurm(script: Path, args: list[str], **environment: str) -> subprocess.CompletedProcess:
    """``script`` with a job's Slurm variables (3 tasks on one node) but no Slurm: its checks run, no step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DTS_"))} | {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NTASKS": "3",
        "SLURM_TASKS_PER_NODE": "3",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS_PER_NODE": "2",
    }
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=30, env=env | environment, cwd=ROOT
    )


@pytest.mark.parametrize(
    "environment, message",
    [
        (
            {"DTS_SERVERS": "two"},
            "ps.sbatch: DTS_SERVERS must be a positive integer (the server shards, one task each), got 'two'",
        ),
        (
            {"DTS_SERVERS": "0"},
            "ps.sbatch: DTS_SERVERS must be a positive integer (the server shards, one task each), got '0'",
        ),
        (
            {"DTS_SERVERS": "3"},
            "ps.sbatch: SLURM_NTASKS=3: DTS_SERVERS=3 needs at least 4 tasks (the server shards and a worker): "
            "sbatch --ntasks=5 for 2 workers",
        ),
        (
            {"DTS_SERVERS": "2", "DTS_SHARD_END_S": "soon"},
            "ps.sbatch: DTS_SHARD_END_S must be a positive integer (seconds), got 'soon'",
        ),
        (
            {"DTS_SERVERS": "2", "DTS_SHARD_RESTARTS": "-1"},
            "ps.sbatch: DTS_SHARD_RESTARTS must be a non-negative integer (restarts of each shard), got '-1'",
        ),
    ],
    ids=["not-a-number", "zero", "no-task-left-for-a-worker", "bad-shard-end", "bad-shard-restarts"],
)
def test_ps_script_refuses_bad_shard_settings(environment, message):
    result = run_outside_slurm(PS_SCRIPT, ["--dataset", "mnist_5k"], **environment)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [message]
