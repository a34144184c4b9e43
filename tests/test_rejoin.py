"""A worker declared failed while it was alive rejoins by itself (src/ps/worker/membership.py,
src/common/supervisor.py).

Claims: what a failed call means and the rejoin budget (``system.max_rejoins``), one line when it
is spent; the launchers' grace for a revoked process (rejoin, or hung and killed, never both); in
virtual time, with the real core and the real worker step, a paused worker is failed, rejoins as a
new incarnation of the same process, pushes again, and the run covers every sample exactly once
with the gradient ledger balanced (computed = applied + residuals); a pause past the grace is a
kill and a restart instead; a spent budget exits and the launcher restarts the process. The library
client rejoins too. The real partition (network namespaces) is in tests/test_ps_multihost.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from src.common.child_processes import process_context
from src.common.supervisor import RejoinGrace
from src.coordinator import check_coverage
from src.metrics import read_events
from src.ps.worker.membership import IncarnationRevoked, Rejoins, failed_call
from src.virtual.run import run_virtual
from tests.ps_fixtures import ps_config

pytestmark = [pytest.mark.alone, pytest.mark.timeout(300)]

SAMPLES = 1000


def test_a_failed_call_means_register_again_rejoin_or_the_callers_error():
    rejoins = Rejoins(1, max_rejoins=2)
    assert failed_call("UNAVAILABLE", "server restarting", 1, rejoins) == "lost"
    assert failed_call("NOT_FOUND", "unknown session", 1, rejoins) == "lost"
    assert failed_call("INVALID_ARGUMENT", "bad push", 1, rejoins) is None
    assert rejoins.used == 0  # only a revocation spends the budget
    assert [failed_call("ABORTED", "incarnation 2 was failed", 1, rejoins) for _ in range(2)] == ["revoked", "revoked"]
    with pytest.raises(IncarnationRevoked) as spent:
        failed_call("ABORTED", "worker 1 incarnation 4 was declared failed", 1, rejoins)
    assert str(spent.value) == (
        "worker 1 incarnation 4 was declared failed; rejoined 2 times already "
        "(system.max_rejoins=2): this process stops"
    )
    with pytest.raises(IncarnationRevoked, match=r"rejoining is off \(system.max_rejoins=0\)"):
        failed_call("ABORTED", "revoked", 1, Rejoins(1, max_rejoins=0))
    with pytest.raises(IncarnationRevoked):  # no budget given: the old rule, stop
        failed_call("ABORTED", "revoked", 1, None)


def test_a_revoked_process_that_rejoins_in_its_grace_is_left_alone_one_that_does_not_is_hung():
    grace = RejoinGrace(3.0)
    grace.failed(0, pid=100, now=10.0)
    grace.failed(1, pid=200, now=11.0)
    assert grace.next_deadline() == 13.0 and grace.due(12.9) == []
    grace.rejoined(0, pid=999)  # another process of worker 0 (a restart) says nothing about pid 100
    grace.rejoined(1, pid=200)
    assert grace.due(13.0) == [(0, 100)] and grace.waiting == {} and grace.next_deadline() is None
    at_once = RejoinGrace(0.0)  # workers that may not rejoin: hung as soon as they are failed
    at_once.failed(2, pid=300, now=5.0)
    assert at_once.due(5.0) == [(2, 300)]


# ----------------------------------------------------------------------------- virtual time

VIRTUAL = dict(
    system__clock="virtual",
    system__num_workers=2,
    training__max_train_samples=SAMPLES,
    training__model_architecture="mlp",  # milliseconds per step on a loaded machine
    training__batch_size=16,
    system__heartbeat_interval=0.5,
    system__heartbeat_timeout=3.0,
    emulation__compute_s=0.25,
    emulation__compress_s=0.001,
    emulation__server_update_s=0.002,
    emulation__server_reply_s=0.001,
    emulation__restart_s=1.0,
    system__compression_enabled=True,
    system__compression_type="topk",
    system__compression_ratio=0.1,
    system__gradient_ledger=True,
)


def events(config, role: str, kind: str | None = None) -> list[dict]:
    path = Path(config.system.log_dir) / role / "events.jsonl"
    return list(read_events(path, kind)) if path.is_file() else []


def assert_ledger_balances(server_ledger: Path, worker_ledgers: list[Path]) -> None:
    """Every gradient a worker computed was applied by the server or waits in its residual."""
    applied = torch.load(server_ledger)["applied"]
    workers = [torch.load(path) for path in worker_ledgers]
    for name, total in applied.items():
        computed = sum(w["computed"][name] for w in workers)
        residuals = sum(w["residuals"][name] for w in workers)
        assert computed.abs().sum() > 0
        torch.testing.assert_close(total + residuals, computed, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_paused_worker_is_failed_rejoins_as_a_new_incarnation_and_pushes_again(tmp_path, mode):
    """Paused 4.5 s at its 3rd step: silent past the 3 s timeout, failed; it runs again within the launcher's
    grace (another 3 s), its push is refused (ABORTED), it rolls that push back into its residual and
    registers again: the same process, a new incarnation; nothing is killed or restarted."""
    config = ps_config(
        tmp_path, mode, system__aggregation_mode=mode, system__inject_faults=["pause=4.5:worker=1@step=3"], **VIRTUAL
    )
    summary = run_virtual(config, tensorboard=False)

    server = events(config, "server")
    (failed,) = [e for e in server if e["kind"] == "worker_failed"]
    (rejoined,) = [e for e in server if e["kind"] == "worker_rejoined"]
    assert (failed["worker"], rejoined["worker"]) == (1, 1) and "silent for" in failed["reason"]
    assert rejoined["pid"] == failed["pid"] and rejoined["incarnation"] > failed["incarnation"]  # the same process
    assert rejoined["time"] > failed["time"]
    pushes_after = [
        e for e in server if e["kind"] == "push" and e["worker"] == 1 and e["incarnation"] == rejoined["incarnation"]
    ]
    assert len([e for e in pushes_after if e["accepted"]]) >= 3
    refused = [e for e in server if e["kind"] == "push_refused" and e["worker"] == 1]
    assert refused == []  # a revoked caller is refused by membership (ABORTED), not counted as a bad push
    launcher = events(config, "launcher")
    assert [e["kind"] for e in launcher] == ["worker_rejoined_by_itself"] and launcher[0]["worker"] == 1
    worker = events(config, "worker_1")
    assert [(e["kind"], e.get("after")) for e in worker if e["kind"] in ("run_start", "rejoined")] == [
        ("run_start", None),
        ("rejoined", "revoked"),
    ]
    assert [e["incarnation"] for e in worker if e["kind"] == "run_end"] == [rejoined["incarnation"]]

    report = check_coverage(server, SAMPLES, 1)
    assert report["ok"], report
    assert summary["samples_processed"] == SAMPLES and summary["faults"]["worker_failures"] == 1
    logs = Path(config.system.log_dir)
    assert_ledger_balances(
        logs / "server" / "gradient_ledger.pt", [logs / f"worker_{k}" / "gradient_ledger.pt" for k in (0, 1)]
    )
    # Each incarnation reports its own work: the two of worker 1 add up to the process's steps.
    steps = {w["incarnation"]: w["steps"] for w in summary["workers"] if w["worker_id"] == 1}
    assert sorted(steps) == [failed["incarnation"], rejoined["incarnation"]]
    pushed = [e for e in worker if e["kind"] == "push"]
    assert steps[rejoined["incarnation"]] == len([e for e in pushed if e["time"] > rejoined["time"]])


def test_a_pause_past_the_grace_is_a_hang_killed_and_restarted_never_also_a_rejoin(tmp_path):
    config = ps_config(
        tmp_path, "long", system__aggregation_mode="async", system__inject_faults=["pause=9:worker=1@step=3"], **VIRTUAL
    )
    run_virtual(config, tensorboard=False)
    launcher = events(config, "launcher")
    assert [(e["kind"], e["worker"]) for e in launcher] == [("worker_killed", 1), ("worker_restarted", 1)]
    server = events(config, "server")
    (failed,) = [e for e in server if e["kind"] == "worker_failed"]
    (rejoined,) = [e for e in server if e["kind"] == "worker_rejoined"]
    assert rejoined["pid"] != failed["pid"]  # the restarted process, not the paused one
    assert check_coverage(server, SAMPLES, 1)["ok"]


def test_a_worker_whose_rejoin_budget_is_spent_exits_and_is_restarted(tmp_path):
    """max_rejoins 1 and two pauses: the first ends in a rejoin, the second in exit status 1 and a restart."""
    config = ps_config(
        tmp_path,
        "budget",
        system__aggregation_mode="async",
        system__max_rejoins=1,
        system__inject_faults=["pause=4.5:worker=1@step=3", "pause=4.5:worker=1@step=8"],
        **VIRTUAL,
    )
    run_virtual(config, tensorboard=False)
    launcher = events(config, "launcher")
    assert [(e["kind"], e.get("exit")) for e in launcher] == [
        ("worker_rejoined_by_itself", None),
        ("worker_restarted", "exited with status 1"),
    ]
    assert check_coverage(events(config, "server"), SAMPLES, 1)["ok"]


# ----------------------------------------------------------------------------- the library's connect


def library_rejoin_worker(address: str, steps: int) -> None:
    """A user's loop over the library (a spawned process the test SIGSTOPs and SIGCONTs from outside)."""
    import torch.nn.functional as F

    from src.training.data import load_dataset
    from tests.library_fixtures import TOKEN, small_mlp
    from torch_asgc import DistributedModel, DistributedOptimizer, build_compressor, connect

    torch.set_num_threads(1)
    train_set = load_dataset("mnist_5k", "train")
    net = small_mlp()
    with connect(address, token=TOKEN, worker_id=0) as client:
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.05), client, compression=build_compressor("topk", ratio=0.1)
        )
        for step in range(steps):
            images, labels = train_set.batch(list(range(step * 16 % 3000, step * 16 % 3000 + 16)))
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
        assert client.incarnation > 1 and client.rejoins.used == 1, (client.incarnation, client.rejoins.used)


def _wait_for(condition, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow  # waits out a heartbeat timeout (~7 s)
@pytest.mark.timeout(180)
def test_a_library_worker_stopped_past_the_timeout_rejoins_when_continued(tmp_path):
    """A real SIGSTOP of a process training through torch_asgc: the server fails it; after SIGCONT its next
    push is refused (ABORTED), it registers again as a new incarnation of the same process, trains on and
    leaves cleanly (exit 0)."""
    import os
    import signal

    from tests.library_fixtures import LibraryServer, library_config

    config = library_config(tmp_path, system__heartbeat_interval=0.3, system__heartbeat_timeout=1.5)
    log = Path(config.system.log_dir) / "server" / "events.jsonl"
    server_events = lambda kind: list(read_events(log, kind)) if log.is_file() else []
    with LibraryServer(config) as served:
        process = process_context().Process(target=library_rejoin_worker, args=(served.address, 400))
        process.start()
        try:
            _wait_for(lambda: len(server_events("push")) >= 5, 120, "the worker's fifth push")
            os.kill(process.pid, signal.SIGSTOP)
            _wait_for(lambda: server_events("worker_failed"), 30, "the server to fail the stopped worker")
            os.kill(process.pid, signal.SIGCONT)
            process.join(120)
            assert process.exitcode == 0
            summary = served.finish()
        finally:
            if process.is_alive():
                process.kill()
            process.join(5)
    (failed,) = server_events("worker_failed")
    (rejoined,) = server_events("worker_rejoined")
    assert rejoined["pid"] == failed["pid"] == process.pid and rejoined["incarnation"] > failed["incarnation"]
    assert [e for e in server_events("push") if e["incarnation"] == rejoined["incarnation"] and e["accepted"]]
    assert summary["worker_incarnations"] == 2


# ----------------------------------------------------------------------------- the local launcher, real processes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_the_local_launcher_a_paused_worker_rejoins_and_is_neither_killed_nor_restarted(tmp_path):
    """A real SIGSTOP for 5 s (a helper sends the SIGCONT) with a 3 s timeout: the server fails worker 1,
    the launcher gives it its grace instead of killing it, and it rejoins as a new incarnation."""
    from src.launch.ps import run_local

    config = ps_config(
        tmp_path,
        "local",
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__max_train_samples=1200,
        system__heartbeat_interval=0.5,
        system__heartbeat_timeout=3.0,
        emulation__step_delay_s=0.2,
        system__inject_faults=["pause=5:worker=1@step=5"],
    )
    summary = run_local(config)
    launcher = events(config, "launcher")
    assert [(e["kind"], e["worker"]) for e in launcher] == [("worker_rejoined_by_itself", 1)]
    server = events(config, "server")
    (failed,) = [e for e in server if e["kind"] == "worker_failed"]
    (rejoined,) = [e for e in server if e["kind"] == "worker_rejoined"]
    assert rejoined["pid"] == failed["pid"] == launcher[0]["pid"] and rejoined["incarnation"] > failed["incarnation"]
    assert [e for e in server if e["kind"] == "push" and e["incarnation"] == rejoined["incarnation"] and e["accepted"]]
    assert check_coverage(server, 1200, 1)["ok"] and summary["samples_processed"] == 1200
