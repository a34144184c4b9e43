"""``scripts/bench_rpc_peer.py``'s reference is the same job: the torch.distributed.rpc parameter server
(``src/benchmarks/ps/rpc_peer.py``) trains the same model on the same batches with the same updates as our sync PS,
so both end on the same loss and accuracy to the last digit; the bench's own table says so per arm
(``same_updates``); a bad flag is one line and exit status 2."""

from __future__ import annotations

import sys

import pytest

from src.benchmarks.ps.peer import training_job
from tests.ps_fixtures import ROOT, run_process

SMALL_JOB = {
    **training_job("simple_cnn", 2, 16),
    "training.max_train_samples": 320,
    "training.max_test_samples": 200,
}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_rpc_peer_computes_the_updates_our_sync_ps_computes(tmp_path):
    from src.benchmarks.ps.peer import PROFILED_SPANS
    from src.benchmarks.ps.rpc_peer import run_rpc_peer
    from src.config import load_config
    from src.launch.ps import run_local
    from src.telemetry.tracing import read_trace

    peer = run_rpc_peer(SMALL_JOB)
    folders = {"system.log_dir": str(tmp_path / "logs"), "system.checkpoint_dir": str(tmp_path / "ckpt")}
    ours = run_local(load_config(overrides={**SMALL_JOB, **folders, "system.transport": "tcp", "system.trace": True}))
    assert peer["samples_processed"] == ours["samples_processed"] == 2 * 320
    assert (peer["final_loss"], peer["final_accuracy"]) == (ours["final_loss"], ours["final_accuracy"])
    assert peer["throughput_samples_per_s"] > 0 and peer["train_time_s"] > 0
    # the profile's two sides (--profile): the peer's phases timed, and every span it reads in our traces
    assert set(peer["phases_ms"]["trainer"]) == {"forward_backward", "update_and_fetch", "copy"}
    assert set(peer["phases_ms"]["server"]) == {"add", "close"}
    assert all(ms > 0 for side in peer["phases_ms"].values() for ms in side.values())
    for role, folder in (("worker", "worker_0"), ("server", "server")):
        traced = {e["name"] for e in read_trace(tmp_path / "logs" / folder / "trace.json") if e.get("ph") == "X"}
        assert set(PROFILED_SPANS[role]) <= traced, (role, set(PROFILED_SPANS[role]) - traced)
    # a different job (another seed) ends elsewhere: the equality above is not one the peer always meets
    other = run_rpc_peer({**SMALL_JOB, "training.seed": 7})
    assert other["final_loss"] != peer["final_loss"]


@pytest.mark.timeout(60)
def test_a_bad_flag_is_one_line_and_exit_2():
    done = run_process(
        [sys.executable, str(ROOT / "scripts" / "bench_rpc_peer.py"), "--repeats", "0"], cwd=ROOT, timeout=50
    )
    assert done.returncode == 2 and "--repeats, --batch-size and --epochs must be at least 1" in done.stderr
    assert done.stdout == ""
