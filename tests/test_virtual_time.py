"""Virtual time: the real server core and the real worker step on a simulated clock (src/virtual/run.py).

Claims: the event loop, the fair-share NIC and the serial server do what their docstrings say; a
virtual run is deterministic (the same summary and events twice, once while other processes load
the machine); its sync barrier is large-batch SGD parameter for parameter (the real server's
contract); 16 async workers with a straggler show the staleness the cost model implies; a kill, a
hang and a server kill are survived with exact coverage, detected within the timeout.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from src.common.checkpoint import load_checkpoint
from src.config import SetupError
from src.coordinator import check_coverage
from src.emulation.cost_model import CostModel, all_gather_s, ring_allreduce_s
from src.emulation.event_loop import EventLoop, SerialServer, SharedLink
from src.metrics import read_events
from src.parameter_server import MONITOR_PERIOD_S
from src.virtual.run import run_virtual
from src.virtual.server import ServerKilled, VirtualServer
from src.virtual.timelines import VirtualTimelines
from tests.ps_fixtures import ROOT, ps_config
from tests.test_ps_equivalence import assert_same_parameters, baseline_parameters

pytestmark = pytest.mark.timeout(300)

COSTS = {"emulation__compute_s": 0.02, "emulation__server_update_s": 0.002, "emulation__server_reply_s": 0.001}


def virtual_config(tmp_path: Path, name: str, **fields):
    return ps_config(tmp_path, name, system__clock="virtual", **{**COSTS, **fields})


def events(config, role: str, kind: str | None = None) -> list[dict]:
    path = Path(config.system.log_dir) / role / "events.jsonl"
    return list(read_events(path, kind)) if path.is_file() else []


# ----------------------------------------------------------------------------- the pieces


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append("b"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(2.0, lambda: seen.append("c"))
    loop.at(1.0, lambda: loop.after(0.5, lambda: seen.append(("nested", loop.now))))
    assert loop.run(until=lambda: False) is False  # ran out of events
    assert seen == ["a", ("nested", 1.5), "b", "c"] and loop.now == 2.0


def test_concurrent_transfers_share_a_nic_fairly_and_a_capped_one_leaves_its_share():
    loop = EventLoop()
    nic = SharedLink(loop, capacity_bps=100.0)
    done = {}
    nic.send(100.0, None, lambda: done.setdefault("a", loop.now))  # alone: 1 s at 100 bit/s ...
    loop.at(0.5, lambda: nic.send(50.0, None, lambda: done.setdefault("b", loop.now)))  # ... then halved
    loop.at(0.5, lambda: nic.send(20.0, 10.0, lambda: done.setdefault("c", loop.now)))  # capped at 10 bit/s
    loop.run(until=lambda: len(done) == 3)
    # From 0.5 s: c gets 10, a and b 45 each; b's 50 bits end at 0.5 + 50/45; then a gets 90 (c still 10).
    b_end = 0.5 + 50 / 45
    a_left = 50 - 45 * (50 / 45)
    assert done["b"] == pytest.approx(b_end)
    assert done["a"] == pytest.approx(b_end + a_left / 90)
    assert done["c"] == pytest.approx(2.5)  # 20 bits at its own 10 bit/s
    unlimited = SharedLink(loop, None)
    unlimited.send(8e6, 1e6, lambda: done.setdefault("own link", loop.now))
    start = loop.now
    loop.run(until=lambda: "own link" in done)
    assert done["own link"] - start == pytest.approx(8.0)  # only its own 1 Mbit/s


def test_the_server_does_one_task_at_a_time_and_a_first_task_jumps_the_queue():
    loop, seen = EventLoop(), []
    cpu = SerialServer(loop)
    cpu.submit(
        1.0,
        lambda: (seen.append(("a", loop.now)), cpu.submit(0.5, lambda: seen.append(("a reply", loop.now)), first=True)),
    )
    cpu.submit(1.0, lambda: seen.append(("b", loop.now)))
    loop.run(until=lambda: len(seen) == 3)
    assert seen == [("a", 1.0), ("a reply", 1.5), ("b", 2.5)]
    cpu.submit(1.0, lambda: seen.append("lost"))
    cpu.reset()  # the process died
    loop.run(until=lambda: False)
    assert "lost" not in seen


def test_a_virtual_run_without_a_figure_it_needs_is_refused_naming_it(tmp_path):
    config = ps_config(tmp_path, "missing", system__clock="virtual", emulation__compute_s=0.01)
    with pytest.raises(SetupError, match=r"emulation.server_update_s: .*scripts/calibrate.py"):
        CostModel(config)
    compressed = virtual_config(tmp_path, "compressed", system__compression_enabled=True)
    with pytest.raises(SetupError, match=r"^emulation.compress_s: "):
        CostModel(compressed)
    faulty = virtual_config(tmp_path, "faulty", system__inject_faults=["kill:worker=0@step=2"])
    with pytest.raises(SetupError, match=r"^emulation.restart_s: "):
        CostModel(faulty)


@pytest.mark.slow
def test_a_virtual_run_without_its_figures_measures_them_here_says_so_and_names_them_in_the_summary(tmp_path, capsys):
    config = ps_config(
        tmp_path, "measured", system__clock="virtual", training__max_train_samples=256, training__num_epochs=1
    )
    summary = run_virtual(config, tensorboard=False)
    said = capsys.readouterr().err
    missing = ["compute_s", "server_update_s", "server_reply_s"]
    assert f"virtual time: {', '.join('emulation.' + m for m in missing)} not in the config; measuring them" in said
    cost = summary["cost_model"]
    assert cost["measured_here"] == sorted(missing)
    assert all(f"{name}={cost[name]:.6g}" in said for name in ("server_update_s", "server_reply_s"))
    assert cost["compute_s"]["0"] > 0 and cost["server_update_s"] > 0 and cost["server_reply_s"] > 0
    assert summary["samples_processed"] == 256
    given = run_virtual(virtual_config(tmp_path, "given", training__max_train_samples=64), tensorboard=False)
    assert "measured_here" not in given["cost_model"] and "virtual time:" not in capsys.readouterr().err


def test_a_virtual_run_with_faults_and_no_restart_time_is_refused_before_measuring_naming_every_missing_figure(
    tmp_path, capsys
):
    config = ps_config(tmp_path, "faulty", system__clock="virtual", system__inject_faults=["kill:worker=0@step=2"])
    with pytest.raises(SetupError, match=r"^emulation.restart_s: .*; emulation.compute_s, .*server_reply_s are"):
        run_virtual(config, tensorboard=False)
    assert "measuring" not in capsys.readouterr().err


def test_ring_and_all_gather_costs():
    # 4 ranks, 1 MB, 8 Mbit/s, 1 ms: 2*3/4 of 8e6 bits at 8e6 bit/s, plus 6 latencies.
    assert ring_allreduce_s(4, 1_000_000, 8e6, 0.001) == pytest.approx(1.5 + 0.006)
    assert ring_allreduce_s(1, 1_000_000, 8e6, 0.001) == 0.0
    assert all_gather_s(4, [1000] * 4, 8e3, 0.0) == pytest.approx(3.0)  # the 3 others' 1000 bytes each


def test_the_straggler_steps_are_stretched_like_a_real_emulated_run(tmp_path):
    config = virtual_config(
        tmp_path, "stretch", system__num_workers=3, emulation__workers={1: {"slowdown": 4}, 2: {"step_delay_s": 0.3}}
    )
    cost = CostModel(config)
    assert cost.step_s(0, 16) == (pytest.approx(0.02), 0.0)
    assert cost.step_s(1, 8) == (pytest.approx(0.04), pytest.approx(0.03))  # half a batch, 4x
    assert cost.step_s(2, 16) == (pytest.approx(0.32), pytest.approx(0.3))  # the spec's additive delay


def test_a_push_sent_uncompressed_costs_no_compression_time(tmp_path):
    cost = CostModel(virtual_config(tmp_path, "compress", system__compression_enabled=True, emulation__compress_s=0.2))
    assert cost.push_compress_s(100, 4000) == 0.2
    assert cost.push_compress_s(4000, 4000) == 0.0  # as many bytes as the dense gradient: identity payloads


def test_a_dying_server_fails_its_open_calls_in_the_order_they_arrived(tmp_path):
    """Not in the order of their memory addresses (a set of calls): that order changes with whatever else the
    process allocated, and with it which worker registers first with the restarted server."""
    config = virtual_config(tmp_path, "dies")
    loop, deaths, failed = EventLoop(), [], []
    launcher = SimpleNamespace(server_died=lambda reason, restart: deaths.append(reason))
    server = VirtualServer(
        config,
        CostModel(config),
        loop,
        VirtualTimelines(config, loop.clock),
        launcher,
        num_train_samples=64,
        test_set=None,
        tensorboard=False,
    )
    server.core = SimpleNamespace(lock=threading.Lock(), log=SimpleNamespace(close=lambda: None))
    server.running, server.epoch = True, 1
    senders = [
        SimpleNamespace(worker_id=0, process=1, bytes_sent=0, uplink_delay_s=0.0, reachable=lambda process: True)
        for _ in range(64)
    ]
    order = random.Random(0).sample(range(len(senders)), len(senders))
    for at, k in enumerate(order):  # one call a millisecond, parked at the server (a Pull waiting for its work)
        loop.at(
            at * 1e-3,
            lambda k=k: server.call(
                senders[k],
                b"x" * 100,
                lambda call, data: None,
                lambda data: None,
                lambda code, message, k=k: failed.append(k),
            ),
        )

    def die() -> None:
        raise ServerKilled("kill:server")

    loop.at(1.0, lambda: server._serve(die))
    loop.run(until=lambda: len(failed) == len(senders))
    assert deaths == ["killed by SIGKILL (kill:server)"] and failed == order


# ----------------------------------------------------------------------------- whole runs


def test_virtual_sync_matches_large_batch_sgd(tmp_path):
    """The same contract the real sync server has (tests/test_ps_equivalence.py), here at 3 workers."""
    expected = baseline_parameters(tmp_path, batch_size=3 * 16, max_train_samples=250, momentum=0.9)
    config = virtual_config(
        tmp_path,
        "sync",
        system__num_workers=3,
        system__aggregation_mode="sync",
        training__max_train_samples=250,
        training__momentum=0.9,
        emulation__uplink_mbps=50,
        emulation__workers={2: {"slowdown": 3}},
    )
    summary = run_virtual(config, tensorboard=False)
    assert summary["clock"] == "virtual" and summary["versions"] == 6 and summary["samples_processed"] == 250
    assert_same_parameters(expected, load_checkpoint(summary["checkpoint_path"])["model_state_dict"])


def test_the_server_without_epoch_evaluations_evaluates_only_the_runs_end(tmp_path):
    """training.eval_at_epoch_ends=False: the parameter server's evaluations (real or virtual, one
    implementation) leave out the epoch ends but the last, and train alike."""
    epochs, final = {}, {}
    for name, on in (("every", True), ("final", False)):
        config = virtual_config(
            tmp_path,
            name,
            system__num_workers=2,
            system__aggregation_mode="sync",
            training__num_epochs=3,
            training__eval_at_epoch_ends=on,
        )
        summary = run_virtual(config, tensorboard=False)
        epochs[name] = [e["epoch"] for e in events(config, "server", "eval")]
        final[name] = load_checkpoint(summary["checkpoint_path"])["model_state_dict"]
    assert epochs == {"every": [1, 2, 3], "final": [3]}
    assert_same_parameters(final["every"], final["final"])


DETERMINISM = dict(
    system__num_workers=4,
    system__aggregation_mode="async",
    system__compression_enabled=True,
    system__compression_type="topk",
    system__compression_ratio=0.1,
    training__max_train_samples=512,
    training__eval_interval=8,
    emulation__compress_s=0.004,
    emulation__uplink_mbps=25,
    emulation__server_mbps=60,
    emulation__step_delay_s=0.01,
    emulation__step_delay_sigma=0.5,
    emulation__workers={3: {"slowdown": 4}},
)


def _run_and_read(tmp_path: Path, name: str) -> tuple[dict, dict[str, list[dict]]]:
    config = virtual_config(tmp_path, name, **DETERMINISM)
    summary = run_virtual(config, tensorboard=False)
    wall = set(summary["wall_time_fields"])  # what may differ: the simulation's own wall time
    logs = {
        role: [{k: v for k, v in e.items() if k not in wall} for e in events(config, role)]
        for role in ("server", "worker_0", "worker_3", "launcher")
    }
    return {k: v for k, v in summary.items() if k not in wall}, logs


@pytest.mark.slow
def test_a_virtual_run_gives_the_same_summary_and_events_twice_even_under_load(tmp_path):
    first = _run_and_read(tmp_path / "a", "run")  # folder names of one length: the config travels in messages
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        second = _run_and_read(tmp_path / "b", "run")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    summary, logs = first
    assert summary["pushes_applied"] > 30 and summary["staleness_histogram"] and logs["server"]
    # Directories differ between the two runs: compare everything else, event by event.
    strip = lambda s: json.loads(
        json.dumps(s).replace(str(tmp_path / "a"), "ROOT").replace(str(tmp_path / "b"), "ROOT")
    )
    assert strip(second[0]) == strip(summary)
    for role in logs:
        assert strip(second[1][role]) == strip(logs[role]), role


@pytest.mark.slow
def test_sixteen_async_workers_with_a_straggler_show_the_staleness_the_cost_model_implies(tmp_path):
    """15 workers step every 20.2 ms (compute + the server's time), one every 80.2 ms: between a fast
    worker's pull and its push the others push 14 + 20.2/80.2 times; during the straggler's step the
    fast ones push 15 x 80.2/20.2 = 59.6 times. The staleness comes from the cost model's times alone, not from
    what is computed, so the workers compute the gradients of an MLP, far cheaper than simple_cnn's."""
    config = virtual_config(
        tmp_path,
        "sixteen",
        training__model_architecture="mlp",
        system__num_workers=16,
        system__aggregation_mode="async",
        training__max_train_samples=3840,
        training__batch_size=16,
        training__num_epochs=2,
        training__max_test_samples=64,
        emulation__server_update_s=0.0001,
        emulation__server_reply_s=0.0001,
        emulation__workers={5: {"slowdown": 4}},
    )
    summary = run_virtual(config, tensorboard=False)
    # The steady state: after the start-up transient, before the queues run dry at the end.
    pushes = [e for e in events(config, "server", "push") if 64 <= e["version"] <= 400]
    fast = [e["staleness"] for e in pushes if e["worker"] != 5]
    slow = [e["staleness"] for e in pushes if e["worker"] == 5]
    assert sum(fast) / len(fast) == pytest.approx(14 + 20.2 / 80.2, rel=0.03)
    assert sum(slow) / len(slow) == pytest.approx(15 * 80.2 / 20.2, rel=0.03)
    assert summary["samples_processed"] == 2 * 3840 and sum(summary["staleness_histogram"].values()) == 480


CHAOS = dict(
    system__num_workers=3,
    training__max_train_samples=1000,
    training__batch_size=16,
    training__num_epochs=2,
    training__checkpoint_interval=10,
    system__heartbeat_interval=0.5,
    system__heartbeat_timeout=3.0,
    emulation__compute_s=0.25,
    emulation__restart_s=1.0,
)


@pytest.mark.slow
@pytest.mark.parametrize("mode, server_dies_at", [("sync", 30), ("async", 100)])  # after the hang is handled
def test_a_killed_a_hung_worker_and_a_killed_server_are_survived_in_virtual_time(tmp_path, mode, server_dies_at):
    faults = ["kill:worker=1@step=5", "hang:worker=2@step=12", f"kill:server@version={server_dies_at}"]
    config = virtual_config(tmp_path, mode, system__aggregation_mode=mode, system__inject_faults=faults, **CHAOS)
    summary = run_virtual(config, tensorboard=False)

    server = events(config, "server")
    assert check_coverage(server, 1000, 2)["ok"], check_coverage(server, 1000, 2)
    launcher = events(config, "launcher")
    assert {e["worker"] for e in launcher if e["kind"] == "worker_restarted"} == {1, 2}
    assert [e["worker"] for e in launcher if e["kind"] == "worker_killed"] == [2]  # the hung one, once declared failed
    assert [e["kind"] for e in launcher if e["kind"] == "server_restarted"] == ["server_restarted"]
    assert {e["worker"] for e in server if e["kind"] == "worker_rejoined"} >= {1, 2}
    assert [e["kind"] for e in server].count("server_recovered") == 1
    # Detection by virtual heartbeats: silence counts from the last heartbeat (at most one interval before
    # the hang), and the monitor looks every MONITOR_PERIOD_S.
    hung_at = next(e["time"] for e in events(config, "worker_2", "fault_injected"))
    failed_at = min(e["time"] for e in server if e["kind"] == "worker_failed" and e["worker"] == 2)
    assert 3.0 - 0.5 <= failed_at - hung_at <= 3.0 + MONITOR_PERIOD_S + 1e-9
    assert summary["faults"]["server_recoveries"] == 1 and summary["faults"]["worker_failures"] >= 2
    assert summary["samples_processed"] == 2000 and summary["final_accuracy"] > 0.5


# ----------------------------------------------------------------------------- calibration and fidelity


def test_calibration_measures_every_figure_a_config_needs_and_prints_them_as_config_lines(tmp_path):
    import yaml

    from src.config import validate_config
    from src.virtual.calibration import as_yaml, calibrate

    config = ps_config(
        tmp_path,
        "calibrate",
        system__compression_enabled=True,
        system__compression_type="topk",
        system__compression_ratio=0.1,
    )
    result = calibrate(config, steps=3)
    figures = result["emulation"]
    assert set(figures) == {"compute_s", "compress_s", "server_update_s", "server_reply_s"}
    assert all(value > 0 for value in figures.values())
    assert (
        figures["server_update_s"]
        <= result["measured"]["round_trip_s"]
        <= figures["server_update_s"] + figures["server_reply_s"] + 1e-12
    )
    pasted = yaml.safe_load(as_yaml(result, config, "x.yaml"))  # what a user pastes into a config
    validated = validate_config(
        {
            **config.to_dict(),
            "emulation": pasted["emulation"],
            "system": {**config.to_dict()["system"], "clock": "virtual"},
        }
    )
    CostModel(validated)  # complete: a virtual run of this config can start


def test_calibration_reads_a_matrix_files_run_sections_with_the_flags_fields_set():
    from src.config import ConfigError
    from src.virtual.calibration import calibration_config

    config = calibration_config(
        ROOT / "configs" / "experiments" / "virtual_ps_vs_ddp.yaml",
        overrides={"training.batch_size": 64, "training.dataset": None},  # None: a flag not given
        assignments={"system.compression_enabled": True},
    )
    assert (config.training.dataset, config.training.batch_size, config.system.num_workers) == ("mnist_5k", 64, 16)
    assert config.system.compression_enabled is True
    assert calibration_config(None).training.dataset == "mnist_5k"  # the defaults
    with pytest.raises(ConfigError, match="nowhere.yaml: config file not found"):
        calibration_config("nowhere.yaml")


@pytest.mark.slow
@pytest.mark.alone  # a real run's measured times against the virtual clock's
def test_virtual_time_matches_a_real_run_of_the_same_experiment_calibrated_here(tmp_path):
    """2 sync workers behind 25 Mbit/s uplinks (configs/experiments/fidelity_uplink_25.yaml, one epoch): the
    virtual run's throughput within 15% of the real run's, its accuracy within a point (sync: the same updates).

    The case whose real re-runs agree among themselves (1.00-1.01 in docs/virtual_time.md): the 2-worker
    straggler case's real runs alone spread by 17% here (a 4x slowdown stretches the measured compute, noise
    included), so one seed of it cannot hold a 15% bound, and CI once measured 1.19 there."""
    from src.config import load_config
    from src.studies.fidelity import compare

    config = load_config(
        Path(__file__).resolve().parent.parent / "configs" / "experiments" / "fidelity_uplink_25.yaml",
        overrides={"training.target_accuracy": None},
    )
    result = compare(config, tmp_path, seeds=(0,), steps=10)
    assert result["throughput_samples_per_s_ratio"] == pytest.approx(1.0, abs=0.15), result
    (real,), (virtual,) = result["real"], result["virtual"]
    assert real["versions"] == virtual["versions"] and abs(real["final_accuracy"] - virtual["final_accuracy"]) <= 0.01


@pytest.mark.slow
def test_a_push_that_goes_uncompressed_spends_no_compression_time(tmp_path):
    """Top-k at rho 1 sends every value uncompressed (the adaptive controller's "no compression"): in virtual time
    it costs what a dense run costs, not ``compress_s`` more a push; top-k at 0.1 spends it on every push but the
    warm-up's (``system.warmup_steps``: each worker's first pushes dense)."""
    common = dict(training__max_train_samples=96, emulation__uplink_mbps=100, emulation__compress_s=0.05)
    dense = run_virtual(
        virtual_config(tmp_path, "dense", **{**common, "emulation__compress_s": None}), tensorboard=False
    )
    runs = {
        rho: run_virtual(
            virtual_config(
                tmp_path,
                f"topk{rho}",
                system__compression_enabled=True,
                system__compression_type="topk",
                system__compression_ratio=rho,
                **common,
            ),
            tensorboard=False,
        )
        for rho in (1.0, 0.1)
    }
    warm = run_virtual(
        virtual_config(
            tmp_path,
            "topk0.1_warmup",
            system__compression_enabled=True,
            system__compression_type="topk",
            system__compression_ratio=0.1,
            system__warmup_steps=2,
            **common,
        ),
        tensorboard=False,
    )
    assert runs[1.0]["compression_time_s"] == 0.0 and runs[1.0]["bytes_sent"] == dense["bytes_sent"]
    assert runs[1.0]["train_time_s"] == dense["train_time_s"]
    assert runs[0.1]["compression_time_s"] == pytest.approx(0.05 * runs[0.1]["pushes_applied"])
    warm_up_pushes = 2 * warm["num_workers"]
    assert warm["pushes_applied"] > warm_up_pushes and warm["bytes_sent"] > runs[0.1]["bytes_sent"]
    assert warm["compression_time_s"] == pytest.approx(0.05 * (warm["pushes_applied"] - warm_up_pushes))
