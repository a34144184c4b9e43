"""The parameter server and two workers as separate hosts: Linux network namespaces joined by a bridge.

Each role runs in its own network namespace with its own address (server 10.77.0.1, workers
10.77.0.2 and .3) and its own loopback, so the run can only work over the veth links, the way it
would across machines. Processes are started through docker/entrypoint.sh, as the containers do (over either transport).
A sharded run puts its second server shard on a host of its own (10.77.0.4; DTS_SHARD, DTS_SHARD_ADDRESSES).
Needs root and iproute2 (CI runs as root).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.metrics import read_events
from tests.netns_fixtures import remove_namespace
from tests.ps_fixtures import ROOT, TOKEN, kill_group, run_cli

# Every run across the hosts shares the machine with an ordinary test (``cluster``): those that detect a worker's
# silence (a kill, a partition) do so from a 3 s heartbeat timeout, with seconds of margin around it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVER_IP, WORKER_IPS = "10.77.0.1", ("10.77.0.2", "10.77.0.3")
SHARD_IPS = (SERVER_IP, "10.77.0.4")  # a sharded run: shard 0 on the first server host, shard 1 on its own


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _prefix() -> str:
    return f"dts{os.getpid() % 100000}"


def worker_link(k: int) -> str:
    """The name of worker ``k``'s end of its veth pair, inside its namespace (``ip link set ... down`` cuts it off)."""
    return f"{_prefix()}h{k}"


@contextlib.contextmanager
def bridged_hosts(server_ips: tuple[str, ...], worker_ips: tuple[str, ...]):
    """Namespaces ``{server, server_1.., worker_0, worker_1..}``: the first server's holds the bridge (as a host
    with a switch), every other host a veth pair onto it, each with its address from ``server_ips`` / ``worker_ips``."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (CI runs as root)")
    prefix = _prefix()
    names = {"server": f"{prefix}s"}
    names |= {f"server_{k}": f"{prefix}s{k}" for k in range(1, len(server_ips))}
    names |= {f"worker_{k}": f"{prefix}w{k}" for k in range(len(worker_ips))}
    # Each host but the bridge's: (role, its address, its end of the veth pair, the bridge's end).
    attached = [(f"worker_{k}", address, worker_link(k), f"{prefix}b{k}") for k, address in enumerate(worker_ips)]
    attached += [(f"server_{k}", server_ips[k], f"{prefix}h{k}s", f"{prefix}b{k}s") for k in range(1, len(server_ips))]
    created, links = [], []
    try:
        for name in names.values():
            ip("netns", "add", name)
            created.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        server = names["server"]
        ip("-n", server, "link", "add", "br0", "type", "bridge")
        ip("-n", server, "addr", "add", f"{server_ips[0]}/24", "dev", "br0")
        ip("-n", server, "link", "set", "br0", "up")
        for role, address, host_end, bridge_end in attached:
            ip("link", "add", bridge_end, "type", "veth", "peer", "name", host_end)
            links.append(bridge_end)
            ip("link", "set", bridge_end, "netns", server)
            ip("link", "set", host_end, "netns", names[role])
            ip("-n", server, "link", "set", bridge_end, "master", "br0", "up")
            ip("-n", names[role], "addr", "add", f"{address}/24", "dev", host_end)
            ip("-n", names[role], "link", "set", host_end, "up")
        yield names
    finally:
        for name in created:
            remove_namespace(name)
        for link in links:  # left in the root namespace only if moving it failed
            subprocess.run(["ip", "link", "del", link], capture_output=True)


@pytest.fixture
def hosts():
    """Namespaces ``{server, worker_0, worker_1}``, with the server's bridge and a veth pair per worker."""
    with bridged_hosts((SERVER_IP,), WORKER_IPS) as names:
        yield names


@pytest.fixture
def sharded_hosts():
    """Namespaces ``{server, server_1, worker_0, worker_1}``: two server shards' hosts and two workers'."""
    with bridged_hosts(SHARD_IPS, WORKER_IPS) as names:
        yield names


def start(namespace: str, environment: dict[str, str], args: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "DTS_AUTH_TOKEN": TOKEN, **environment}
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, "bash", str(ROOT / "docker" / "entrypoint.sh"), *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.cluster
@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_server_and_workers_on_separate_hosts(hosts, tmp_path, transport):
    logs = tmp_path / "logs"
    processes = []
    outputs = {role: open(tmp_path / f"{role}.out", "w+") for role in hosts}
    chosen = {"DTS_TRANSPORT": transport}  # as docker-compose.yml passes it: the entrypoint adds --transport
    try:
        processes.append(
            start(
                hosts["server"],
                {"DTS_ROLE": "server", "DTS_SERVER_ADDRESS": f"{SERVER_IP}:50051", **chosen},
                [
                    *(
                        "--workers 2 --dataset mnist_5k --num-epochs 1 --max-train-samples 256 "
                        "--max-test-samples 128 --checkpoint-dir"
                    ).split(),
                    str(tmp_path / "ckpt"),
                    "--log-dir",
                    str(logs / "server_host"),
                ],
                outputs["server"],
            )
        )
        for k in (0, 1):
            processes.append(
                start(
                    hosts[f"worker_{k}"],
                    {
                        "DTS_ROLE": "worker",
                        "DTS_WORKER_ID": str(k),
                        "DTS_SERVER_ADDRESS": f"{SERVER_IP}:50051",
                        **chosen,
                    },
                    ["--log-dir", str(logs / f"worker_host_{k}")],
                    outputs[f"worker_{k}"],
                )
            )
        codes = [process.wait(timeout=240) for process in processes]
        text = {}
        for role, handle in outputs.items():
            handle.seek(0)
            text[role] = handle.read()
        assert codes == [0, 0, 0], text
    finally:
        for process in processes:
            kill_group(process)
            process.wait()
        for handle in outputs.values():
            handle.close()

    assert "Final Accuracy:" in text["server"] and f"listening on {SERVER_IP}:50051 ({transport}," in text["server"]
    peers = sorted(
        event["peer"] for event in read_events(logs / "server_host" / "server" / "events.jsonl", kind="register")
    )
    assert [peer.rsplit(":", 1)[0] for peer in peers] == [f"ipv4:{address}" for address in WORKER_IPS]
    for k in (0, 1):
        assert f"worker {k}: 128 samples" in text[f"worker_{k}"]
        assert (logs / f"worker_host_{k}" / f"worker_{k}" / "events.jsonl").is_file()
    assert (tmp_path / "ckpt" / "parameter_server_final.pt").is_file()


# A sharded run (2 server shards): 64 kB slices, so simple_cnn's larger tensors are cut across the shards.
SHARDED_RUN = (
    "--workers 2 --dataset mnist_5k --num-epochs 1 --max-train-samples 256 --max-test-samples 128 "
    "--set system.shard_slice_bytes=65536"
).split()
SHARDED_VERSIONS = 2  # 256 samples, 2 workers x the default batch of 64 a step
FOLLOWER_END_S = 60  # a follower ends by itself this soon after shard 0 (it polls shard 0 every second)


@pytest.fixture(scope="module")
def local_two_shards(tmp_path_factory):
    """The same sharded run by the local launcher on this host (``--servers 2``): its summary and final model."""
    out = tmp_path_factory.mktemp("local_two_shards")
    result = run_cli(
        ["--servers", "2", *SHARDED_RUN, "--checkpoint-dir", str(out / "ckpt"), "--log-dir", str(out / "logs")],
        cwd=out,
        env={"DTS_AUTH_TOKEN": TOKEN},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "logs" / "summary.json").read_text())
    return summary, load_checkpoint(out / "ckpt" / "parameter_server_final.pt")


@pytest.mark.cluster
@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_two_server_shards_and_workers_on_separate_hosts(sharded_hosts, local_two_shards, tmp_path, transport):
    """Shard 0, shard 1 and two workers, each on its own host, started through docker/entrypoint.sh with
    DTS_SHARD / DTS_SHARD_ADDRESSES: shard 0 binds the address it is given, shard 1 (on another port) the entrypoint's
    default (every interface, its entry's port), and the workers reach shard 0 at the list's first entry. No disk
    is shared: shard 0 reads shard 1's part over the network. Every process exits 0 by itself (shard 1 once shard 0
    has ended the run); the whole model in shard 0's final checkpoint is the local launcher's ``--servers 2`` run's."""
    from src.config import config_from_data
    from src.trainer import model_from_config

    shard_0, shard_1 = f"{SHARD_IPS[0]}:50051", f"{SHARD_IPS[1]}:50052"
    shards = {"DTS_SHARD_ADDRESSES": f"{shard_0},{shard_1}", "DTS_TRANSPORT": transport}
    processes = {}
    outputs = {role: open(tmp_path / f"{role}.out", "w+") for role in sharded_hosts}
    host_dirs = lambda host: [
        "--checkpoint-dir",
        str(tmp_path / host / "ckpt"),
        "--log-dir",
        str(tmp_path / host / "logs"),
    ]
    try:
        processes["server_1"] = start(
            sharded_hosts["server_1"],
            {"DTS_ROLE": "server", "DTS_SHARD": "1", **shards},
            [*SHARDED_RUN, *host_dirs("shard_1_host")],
            outputs["server_1"],
        )
        processes["server"] = start(
            sharded_hosts["server"],
            {"DTS_ROLE": "server", "DTS_SERVER_ADDRESS": shard_0, **shards},  # DTS_SHARD: 0 by default
            [*SHARDED_RUN, *host_dirs("shard_0_host")],
            outputs["server"],
        )
        for k in (0, 1):
            processes[f"worker_{k}"] = start(
                sharded_hosts[f"worker_{k}"],
                {"DTS_ROLE": "worker", "DTS_WORKER_ID": str(k), **shards},
                ["--log-dir", str(tmp_path / f"worker_host_{k}" / "logs")],
                outputs[f"worker_{k}"],
            )
        codes, text = wait_and_read(processes, ("server", "worker_0", "worker_1"), outputs)
        try:
            codes["server_1"] = processes["server_1"].wait(timeout=FOLLOWER_END_S)
        except subprocess.TimeoutExpired:
            codes["server_1"] = f"still running {FOLLOWER_END_S} s after shard 0 ended"
        _, text = wait_and_read(processes, (), outputs)
        assert codes == {"server": 0, "worker_0": 0, "worker_1": 0, "server_1": 0}, text
    finally:
        stop(processes, outputs)

    assert f"listening on {shard_0} ({transport}," in text["server"] and "Final Accuracy:" in text["server"]
    assert "parameter-server shard 1 of 2 listening on port 50052" in text["server_1"], text["server_1"]
    assert "parameter-server shard 1: the run is over; its part of the model is in" in text["server_1"]
    for k in (0, 1):
        assert f"worker {k}: 128 samples" in text[f"worker_{k}"]
    shard_0_logs = tmp_path / "shard_0_host" / "logs"
    peers = sorted(event["peer"] for event in read_events(shard_0_logs / "server" / "events.jsonl", kind="register"))
    assert [peer.rsplit(":", 1)[0] for peer in peers] == [f"ipv4:{address}" for address in WORKER_IPS]
    assert (tmp_path / "shard_1_host" / "logs" / "server_1" / "events.jsonl").is_file()
    assert not (tmp_path / "shard_0_host" / "logs" / "server_1").exists()  # no shared disk

    summary = json.loads((shard_0_logs / "summary.json").read_text())
    assert (summary["versions"], summary["samples_processed"]) == (SHARDED_VERSIONS, 256), summary
    placement = summary["placement"]
    assert placement["num_shards"] == 2 and all(placement["slices_per_shard"]), placement
    assert any("#" in key for shard in placement["slices_per_shard"] for key in shard), "no tensor was cut"

    final = load_checkpoint(tmp_path / "shard_0_host" / "ckpt" / "parameter_server_final.pt")
    model = model_from_config(config_from_data(final["config"]))
    assert list(final["model_state_dict"]) == list(model.state_dict()), "not the whole model"
    assert final["extra"]["num_servers"] == 2 and final["extra"]["version"] == SHARDED_VERSIONS
    reference_summary, reference = local_two_shards
    assert summary["final_accuracy"] == pytest.approx(reference_summary["final_accuracy"], abs=1e-6)
    for name, value in reference["model_state_dict"].items():
        torch.testing.assert_close(
            final["model_state_dict"][name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}"
        )


def events(path, kind):
    return list(read_events(path, kind)) if path.is_file() else []


def wait_and_read(processes: dict, roles, outputs: dict) -> tuple[dict, dict]:
    """Wait for the processes of ``roles`` to exit; their exit codes and everything each role printed."""
    codes = {role: processes[role].wait(timeout=240) for role in roles}
    text = {}
    for role, handle in outputs.items():
        handle.seek(0)
        text[role] = handle.read()
    return codes, text


def stop(processes: dict, outputs: dict) -> None:
    for process in processes.values():
        kill_group(process)
        process.wait()
    for handle in outputs.values():
        handle.close()


def wait_for(condition, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.cluster
def test_a_worker_killed_on_its_host_is_survived_and_rejoins_when_started_again(hosts, tmp_path):
    """Worker 1's host kills it mid-run: the server fails it after the heartbeat timeout and goes on (no hang);
    started again by hand, it registers as a new incarnation and trains until the run ends."""
    from src.coordinator import check_coverage

    logs = tmp_path / "logs"
    server_events = logs / "server_host" / "server" / "events.jsonl"
    worker_1_events = logs / "worker_host_1" / "worker_1" / "events.jsonl"
    processes = {}
    outputs = {role: open(tmp_path / f"{role}.out", "w+") for role in [*hosts, "worker_1_again"]}
    worker = lambda k: (
        {"DTS_ROLE": "worker", "DTS_WORKER_ID": str(k), "DTS_SERVER_ADDRESS": f"{SERVER_IP}:50051"},
        ["--log-dir", str(logs / f"worker_host_{k}")],
    )

    try:
        processes["server"] = start(
            hosts["server"],
            {"DTS_ROLE": "server", "DTS_SERVER_ADDRESS": f"{SERVER_IP}:50051"},
            [
                "--workers",
                "2",
                "--dataset",
                "mnist_5k",
                "--num-epochs",
                "1",
                "--max-train-samples",
                "2000",
                "--batch-size",
                "16",
                "--max-test-samples",
                "128",
                "--heartbeat-interval",
                "0.5",
                # >= 0.1 s a round: worker 0 alone needs over 10 s for the ~110 batches left
                # when worker 1 is failed, so the run outlasts the start of a new worker 1
                # process (python, torch) whatever the machine's speed
                "--heartbeat-timeout",
                "3",
                "--step-delay-s",
                "0.1",
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
                "--log-dir",
                str(logs / "server_host"),
            ],
            outputs["server"],
        )
        for k in (0, 1):
            processes[f"worker_{k}"] = start(hosts[f"worker_{k}"], *worker(k), outputs[f"worker_{k}"])
        wait_for(lambda: len(events(worker_1_events, "push")) >= 5, 180, "worker 1's fifth push")
        kill_group(processes["worker_1"])
        processes["worker_1"].wait()
        wait_for(lambda: events(server_events, "worker_failed"), 30, "the server to fail worker 1")
        versions_at_failure = max(e["version"] for e in events(server_events, "update"))
        wait_for(
            lambda: max(e["version"] for e in events(server_events, "update")) > versions_at_failure + 3,
            60,
            "the run to go on without worker 1",
        )
        processes["worker_1_again"] = start(hosts["worker_1"], *worker(1), outputs["worker_1_again"])
        codes, text = wait_and_read(processes, ("server", "worker_0", "worker_1_again"), outputs)
        assert codes == {"server": 0, "worker_0": 0, "worker_1_again": 0}, text
    finally:
        stop(processes, outputs)

    failed = events(server_events, "worker_failed")
    assert [e["worker"] for e in failed] == [1] and "silent for" in failed[0]["reason"]
    rejoined = events(server_events, "worker_rejoined")
    assert [e["worker"] for e in rejoined] == [1] and rejoined[0]["incarnation"] > failed[0]["incarnation"]
    starts = [e["incarnation"] for e in events(worker_1_events, "run_start")]
    assert starts == [failed[0]["incarnation"], rejoined[0]["incarnation"]]  # the new process trained too
    report = check_coverage(events(server_events, None), 2000, 1)
    assert report["ok"], report


def _partition_server_args(tmp_path, logs):
    """The server's flags for the partition test: 100 batches of 16, heartbeats every 0.5 s, top-k with a ledger.

    At >= 0.2 s a round (--step-delay-s), worker 0 alone cannot finish the run's 100 batches during the
    10 s partition, whatever the machine's speed."""
    flags = (
        "--workers 2 --dataset mnist_5k --num-epochs 1 --max-train-samples 1600 --batch-size 16"
        " --max-test-samples 128 --heartbeat-interval 0.5 --heartbeat-timeout 3 --step-delay-s 0.2"
        " --compression-enabled --compression-type topk --compression-ratio 0.1 --set system.gradient_ledger=true"
    )
    return [*flags.split(), "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(logs / "server_host")]


@pytest.mark.cluster
def test_a_worker_partitioned_for_10s_is_failed_rejoins_by_itself_and_finishes(hosts, tmp_path):
    """Worker 1's link goes down for 10 s mid-run (its process runs on): the server fails it after the 3 s
    heartbeat timeout and goes on with worker 0; back online, worker 1's next call is refused (ABORTED),
    it rolls back what was not applied and registers again as a new incarnation of the same process,
    pushes again and exits 0. Every sample is in exactly one applied update and the gradient ledger
    balances: computed (both workers) = applied (server) + residuals (both workers)."""
    import time

    from src.coordinator import check_coverage
    from tests.test_rejoin import assert_ledger_balances

    logs = tmp_path / "logs"
    server_events = logs / "server_host" / "server" / "events.jsonl"
    worker_1_events = logs / "worker_host_1" / "worker_1" / "events.jsonl"
    processes = {}
    outputs = {role: open(tmp_path / f"{role}.out", "w+") for role in hosts}

    try:
        processes["server"] = start(
            hosts["server"],
            {"DTS_ROLE": "server", "DTS_SERVER_ADDRESS": f"{SERVER_IP}:50051"},
            _partition_server_args(tmp_path, logs),
            outputs["server"],
        )
        for k in (0, 1):
            processes[f"worker_{k}"] = start(
                hosts[f"worker_{k}"],
                {"DTS_ROLE": "worker", "DTS_WORKER_ID": str(k), "DTS_SERVER_ADDRESS": f"{SERVER_IP}:50051"},
                ["--log-dir", str(logs / f"worker_host_{k}")],
                outputs[f"worker_{k}"],
            )
        wait_for(lambda: len(events(worker_1_events, "push")) >= 5, 180, "worker 1's fifth push")
        ip("-n", hosts["worker_1"], "link", "set", worker_link(1), "down")
        cut_at = time.monotonic()
        try:
            wait_for(
                lambda: events(server_events, "worker_failed"), 9, "the server to fail worker 1 while it is cut off"
            )
            time.sleep(max(0.0, 10.0 - (time.monotonic() - cut_at)))  # the partition lasts 10 s (not a condition)
        finally:
            ip("-n", hosts["worker_1"], "link", "set", worker_link(1), "up")
        codes, text = wait_and_read(processes, list(processes), outputs)
        assert codes == {"server": 0, "worker_0": 0, "worker_1": 0}, text
    finally:
        stop(processes, outputs)

    (failed,) = events(server_events, "worker_failed")
    (rejoined,) = events(server_events, "worker_rejoined")
    assert failed["worker"] == rejoined["worker"] == 1 and "silent for" in failed["reason"]
    assert rejoined["pid"] == failed["pid"] and rejoined["incarnation"] > failed["incarnation"]  # the same process
    assert rejoined["peer"].startswith(f"ipv4:{WORKER_IPS[1]}:")
    pushed_again = [
        e for e in events(server_events, "push") if e["worker"] == 1 and e["incarnation"] == rejoined["incarnation"]
    ]
    assert pushed_again and all(e["accepted"] for e in pushed_again)
    assert [e["after"] for e in events(worker_1_events, "rejoined")] == ["revoked"]
    assert "rejoining as a new incarnation (rejoin 1/3)" in text["worker_1"]
    report = check_coverage(events(server_events, None), 1600, 1)
    assert report["ok"], report
    assert_ledger_balances(
        logs / "server_host" / "server" / "gradient_ledger.pt",
        [logs / f"worker_host_{k}" / f"worker_{k}" / "gradient_ledger.pt" for k in (0, 1)],
    )
