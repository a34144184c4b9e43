"""Emulated stragglers and links (src/emulation/netem.py): the arithmetic, the config, and real runs against it.

The slow tests run real parameter-server processes: a run's communication time against bytes /
bandwidth + latency, a straggler run async vs sync, and an emulated link against the same link
shaped for real by ``tc`` on a veth pair between network namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

from src.config import ConfigError, SetupError, load_config
from src.emulation import netem
from src.metrics import read_events
from tests.netns_fixtures import remove_namespace, shape_egress
from tests.ps_fixtures import ROOT, RUNNER, TOKEN, kill_group, ps_config

pytestmark = pytest.mark.alone

# ----------------------------------------------------------------------------- arithmetic and config


def test_a_message_waits_bytes_over_bandwidth_plus_latency():
    spec = netem.LinkSpec(bandwidth_mbps=250, latency_ms=5)
    assert spec.transfer_s(1_000_000) == pytest.approx(8e6 / 250e6 + 0.005)
    assert netem.LinkSpec(None, 20).transfer_s(10**9) == pytest.approx(0.02)
    assert netem.LinkSpec.of(None, 0) is None  # neither limit: no link to emulate
    waited = []
    link = netem.Link(netem.LinkSpec(8, 0), sleep=waited.append)
    assert link.transmit(1_000_000) == pytest.approx(1.0)  # 8 Mbit over 8 Mbit/s
    link.transmit(500_000)
    assert waited == pytest.approx([1.0, 0.5]) and link.delay_s == pytest.approx(1.5)
    assert (link.messages, link.bytes) == (2, 1_500_000)


def test_compute_delay_stretches_the_measured_step_and_draws_seeded_log_normal_delays():
    waited = []
    slow = netem.ComputeDelay(netem.WorkerConditions(slowdown=4), seed=1, sleep=waited.append)
    assert slow.after_step(0.1) == pytest.approx(0.3) and waited == pytest.approx([0.3])  # 0.1 s -> 0.4 s in all
    assert not netem.ComputeDelay(netem.WorkerConditions(), seed=1).active

    conditions = netem.WorkerConditions(step_delay_s=0.02, step_delay_sigma=0.5)
    draws = [netem.ComputeDelay(conditions, seed=7, sleep=lambda s: None) for _ in range(2)]
    first = [draws[0].extra_s(0.0) for _ in range(2001)]
    assert first == [draws[1].extra_s(0.0) for _ in range(2001)]  # same seed, same delays
    assert statistics.median(first) == pytest.approx(0.02, rel=0.08)  # median step_delay_s
    assert min(first) > 0 and max(first) > 2 * 0.02  # spread (sigma 0.5: the 99th percentile is 3.2x)
    other = netem.ComputeDelay(conditions, seed=8, sleep=lambda s: None)
    assert [other.extra_s(0.0) for _ in range(5)] != first[:5]


def test_per_worker_overrides_resolve_against_the_defaults():
    config = load_config(
        overrides={
            "system.num_workers": 3,
            "emulation.uplink_mbps": 250,
            "emulation.downlink_latency_ms": 2,
            "emulation.workers": {1: {"slowdown": 4}, 2: {"uplink_mbps": 50}},
        }
    )
    emulation = config.emulation
    assert netem.conditions_for(emulation, 0) == netem.WorkerConditions(uplink_mbps=250, downlink_latency_ms=2)
    assert netem.conditions_for(emulation, 1).slowdown == 4 and netem.conditions_for(emulation, 1).uplink_mbps == 250
    assert netem.conditions_for(emulation, 2).uplink == netem.LinkSpec(50, 0)
    assert netem.conditions_for(emulation, 2).downlink == netem.LinkSpec(None, 2)
    described = netem.describe(emulation, 3)
    assert described["workers"]["1"] == {"slowdown": 4, "uplink_mbps": 250, "downlink_latency_ms": 2}
    assert netem.describe(load_config().emulation, 2) is None
    # the server sends its run config to the workers as JSON: the overrides survive the trip
    again = load_config(
        overrides={f"emulation.{k}": v for k, v in json.loads(config.model_dump_json())["emulation"].items()}
    )
    assert netem.conditions_for(again.emulation, 1) == netem.conditions_for(emulation, 1)
    with pytest.raises(SetupError, match=r"emulation.workers: worker ids \[5\] are not workers of this run"):
        netem.check_workers(load_config(overrides={"emulation.workers": {5: {"slowdown": 2}}}).emulation, 2)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"emulation.slowdown": 0.5}, "emulation.slowdown: must be >= 1"),
        ({"emulation.uplink_mbps": 0}, "emulation.uplink_mbps: must be > 0 (or null: not limited), got 0"),
        ({"emulation.downlink_latency_ms": -1}, "emulation.downlink_latency_ms: must be >= 0, got -1"),
        ({"emulation.workers": {1: {"step_delay_sigma": -0.1}}}, "emulation.workers.1.step_delay_sigma: must be >= 0"),
        ({"emulation.workers": {1: {"bandwidth": 5}}}, "emulation.workers.1.bandwidth: unknown key"),
    ],
)
def test_bad_emulation_fields_are_named(overrides, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=overrides)
    assert any(problem.startswith(expected) for problem in caught.value.problems), caught.value.problems


def test_emulation_flags_map_onto_the_config():
    import run_parameter_server_training as runner  # the root runner (pytest puts the root on sys.path)
    from src.launch.cli import EMULATION_FLAGS, config_from_args

    args = runner.build_parser().parse_args(
        "--slow-worker 1=4 --slow-worker 0=1.5 --uplink-mbps 250 --downlink-latency-ms 3 --step-delay-s 0.01".split()
    )
    config = config_from_args(args, defaults={}, extra_flags=EMULATION_FLAGS)
    assert {k: w.slowdown for k, w in config.emulation.workers.items()} == {1: 4.0, 0: 1.5}
    assert (config.emulation.uplink_mbps, config.emulation.downlink_latency_ms, config.emulation.step_delay_s) == (
        250,
        3,
        0.01,
    )
    with pytest.raises(SystemExit):
        runner.build_parser().parse_args(["--slow-worker", "1x4"])


# ----------------------------------------------------------------------------- real runs


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_runs_communication_time_matches_bytes_over_bandwidth_plus_latency(tmp_path):
    """One worker, 10 Mbit/s each way + 20 ms latency: each step's round trip is ~1.5 s of link time, so
    the real work (serializing, the server's update) is a few percent of it."""
    from src.launch.ps import run_local

    up, down, latency_up_ms, latency_down_ms = 10.0, 10.0, 20.0, 20.0
    config = ps_config(
        tmp_path,
        training__model_architecture="mlp",
        training__max_train_samples=96,
        emulation__uplink_mbps=up,
        emulation__downlink_mbps=down,
        emulation__uplink_latency_ms=latency_up_ms,
        emulation__downlink_latency_ms=latency_down_ms,
    )
    summary = run_local(config)
    pushes = list(read_events(tmp_path / "run" / "logs" / "worker_0" / "events.jsonl", "push"))
    assert len(pushes) == 6
    expected = sum(
        8 * p["push_bytes"] / (up * 1e6)
        + latency_up_ms / 1e3
        + 8 * p["reply_bytes"] / (down * 1e6)
        + latency_down_ms / 1e3
        for p in pushes
    )
    worker = summary["workers"][0]
    assert worker["communication_time_s"] == pytest.approx(expected, rel=0.10), (worker, expected)
    assert worker["communication_time_s"] >= expected  # the waits are a floor: the real work comes on top
    # what the summary says was on, and the waits it counted
    assert summary["emulation"]["workers"]["0"] == {
        "uplink_mbps": up,
        "downlink_mbps": down,
        "uplink_latency_ms": latency_up_ms,
        "downlink_latency_ms": latency_down_ms,
    }
    uplink_waits = worker["bytes_sent"] * 8 / (up * 1e6)  # every message sent (register, pull, heartbeats too) waited
    assert worker["emulated_delay_s"] >= uplink_waits
    assert summary["emulation"]["downlink_delay_s"]["0"] > sum(8 * p["reply_bytes"] / (down * 1e6) for p in pushes)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_beats_sync_to_the_same_accuracy_with_one_worker_4x_slower(tmp_path):
    from src.launch.ps import run_local

    summaries = {}
    for mode in ("sync", "async"):
        config = ps_config(
            tmp_path,
            mode,
            system__num_workers=2,
            system__aggregation_mode=mode,
            training__max_train_samples=1024,
            training__max_test_samples=300,
            training__batch_size=32,
            training__num_epochs=2,
            training__momentum=0.4,
            training__eval_interval=4,
            training__target_accuracy=0.6,
            emulation__workers={1: {"slowdown": 4}},
        )
        summaries[mode] = run_local(config)
    sync, async_ = summaries["sync"], summaries["async"]
    assert sync["time_to_target_s"] is not None and async_["time_to_target_s"] is not None, (sync, async_)
    assert async_["time_to_target_s"] < sync["time_to_target_s"], (async_["time_to_target_s"], sync["time_to_target_s"])
    assert async_["throughput_samples_per_s"] > sync["throughput_samples_per_s"]
    # the straggler is emulated in both: it waited about 3x its compute every step
    for summary in (sync, async_):
        slow = next(w for w in summary["workers"] if w["worker_id"] == 1)
        assert slow["emulated_delay_s"] == pytest.approx(3 / 4 * slow["gradient_time_s"], rel=0.15)
        assert summary["emulation"] == {"workers": {"1": {"slowdown": 4.0}}}
    # async: the fast worker takes the straggler's work, so it computes most samples
    fast = next(w for w in async_["workers"] if w["worker_id"] == 0)
    assert fast["samples"] > 0.6 * async_["samples_processed"]


# ----------------------------------------------------------------------------- the real thing: tc on veth links

SERVER_IP, WORKER_IP = "10.78.0.1", "10.78.0.2"
SHAPED_MBPS = 20


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def link_pair():
    """Namespaces ``{"server": ..., "worker": ...}`` joined by a veth pair (ends ``"server_dev"``, ``"worker_dev"``)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces and tc need root and iproute2 (CI runs as root)")
    prefix = f"dtn{os.getpid() % 100000}"
    names = {"server": f"{prefix}s", "worker": f"{prefix}w", "server_dev": f"{prefix}a", "worker_dev": f"{prefix}b"}
    created = []
    try:
        for role in ("server", "worker"):
            _ip("netns", "add", names[role])
            created.append(names[role])
            _ip("-n", names[role], "link", "set", "lo", "up")
        _ip("link", "add", names["server_dev"], "type", "veth", "peer", "name", names["worker_dev"])
        for role, address in (("server", SERVER_IP), ("worker", WORKER_IP)):
            device = names[f"{role}_dev"]
            _ip("link", "set", device, "netns", names[role])
            _ip("-n", names[role], "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", names[role], "link", "set", device, "up")
        yield names
    finally:
        for name in created:
            remove_namespace(name)  # takes its veth end with it
        subprocess.run(["ip", "link", "del", names["server_dev"]], capture_output=True)  # only if moving it failed


def _run_across(names, tmp_path, label: str, extra_server_args: list[str]) -> dict:
    """The server in one namespace, one worker in the other; returns the run summary."""
    logs, outputs, processes = tmp_path / label, {}, []
    env = {**os.environ, "DTS_AUTH_TOKEN": TOKEN}
    common = ["--log-dir", str(logs), "--checkpoint-dir", str(logs / "ckpt")]
    server_args = [
        "--role",
        "server",
        "--server-address",
        f"{SERVER_IP}:50061",
        *(
            "--workers 1 --model mlp --aggregation-mode async --batch-size 16 "
            "--max-train-samples 160 --max-test-samples 64 --num-epochs 1 "
            "--checkpoint-interval 100000"
        ).split(),
        *extra_server_args,
        *common,
    ]
    worker_args = ["--role", "worker", "--worker-id", "0", "--server-address", f"{SERVER_IP}:50061", *common]
    try:
        for role, args in (("server", server_args), ("worker", worker_args)):
            outputs[role] = open(tmp_path / f"{label}_{role}.out", "w+")
            processes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", names[role], sys.executable, str(RUNNER), *args],
                    cwd=ROOT,
                    env=env,
                    stdout=outputs[role],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        codes = [process.wait(timeout=240) for process in processes]
        text = {}
        for role, handle in outputs.items():
            handle.seek(0)
            text[role] = handle.read()
        assert codes == [0, 0], text
    finally:
        for process in processes:
            kill_group(process)
            process.wait()
        for handle in outputs.values():
            handle.close()
    return json.loads((logs / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_emulated_link_agrees_with_the_same_link_shaped_by_tc(link_pair, tmp_path):
    """10 steps of an mlp (0.94 MB each way per step) at 20 Mbit/s both ways: emulated in the sender,
    then shaped by a token bucket on each veth end. Training wall time agrees within 25%."""
    emulated = _run_across(
        link_pair, tmp_path, "emulated", ["--uplink-mbps", str(SHAPED_MBPS), "--downlink-mbps", str(SHAPED_MBPS)]
    )
    shape_egress(link_pair["worker"], link_pair["worker_dev"], SHAPED_MBPS)  # uplink: the worker's egress
    shape_egress(link_pair["server"], link_pair["server_dev"], SHAPED_MBPS)  # downlink: the server's egress
    shaped = _run_across(link_pair, tmp_path, "shaped", [])
    assert emulated["emulation"] is not None and shaped["emulation"] is None
    assert emulated["samples_processed"] == shaped["samples_processed"] == 160
    assert emulated["bytes_sent"] == pytest.approx(shaped["bytes_sent"], rel=0.01)
    # the link dominates: 10 steps x ~0.75 s each way
    assert emulated["train_time_s"] > 10 * 2 * 0.9 * 8 * 0.94e6 / (SHAPED_MBPS * 1e6)
    assert shaped["train_time_s"] == pytest.approx(emulated["train_time_s"], rel=0.25), (
        shaped["train_time_s"],
        emulated["train_time_s"],
    )
