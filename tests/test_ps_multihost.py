"""The parameter server and two workers as separate hosts: Linux network namespaces joined by a bridge.

Each role runs in its own network namespace with its own address (server 10.77.0.1, workers
10.77.0.2 and .3) and its own loopback, so the run can only work over the veth links, the way it
would across machines. Processes are started through docker/entrypoint.sh, as the containers do (over either transport).
Needs root and iproute2 (CI runs as root).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from src.metrics import read_events
from tests.netns_fixtures import remove_namespace
from tests.ps_fixtures import ROOT, TOKEN, kill_group

pytestmark = [pytest.mark.alone, pytest.mark.slow, pytest.mark.timeout(300)]

SERVER_IP, WORKER_IPS = "10.77.0.1", ("10.77.0.2", "10.77.0.3")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _prefix() -> str:
    return f"dts{os.getpid() % 100000}"


def worker_link(k: int) -> str:
    """The name of worker ``k``'s end of its veth pair, inside its namespace (``ip link set ... down`` cuts it off)."""
    return f"{_prefix()}h{k}"


@pytest.fixture
def hosts():
    """Namespaces ``{server, worker_0, worker_1}``, with the server's bridge and a veth pair per worker."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (CI runs as root)")
    prefix = _prefix()
    names = {"server": f"{prefix}s", "worker_0": f"{prefix}w0", "worker_1": f"{prefix}w1"}
    created, links = [], []
    try:
        for name in names.values():
            ip("netns", "add", name)
            created.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        server = names["server"]
        ip("-n", server, "link", "add", "br0", "type", "bridge")
        ip("-n", server, "addr", "add", f"{SERVER_IP}/24", "dev", "br0")
        ip("-n", server, "link", "set", "br0", "up")
        for k, worker_ip in enumerate(WORKER_IPS):
            bridge_end, host_end = f"{prefix}b{k}", worker_link(k)
            ip("link", "add", bridge_end, "type", "veth", "peer", "name", host_end)
            links.append(bridge_end)
            ip("link", "set", bridge_end, "netns", server)
            ip("link", "set", host_end, "netns", names[f"worker_{k}"])
            ip("-n", server, "link", "set", bridge_end, "master", "br0", "up")
            ip("-n", names[f"worker_{k}"], "addr", "add", f"{worker_ip}/24", "dev", host_end)
            ip("-n", names[f"worker_{k}"], "link", "set", host_end, "up")
        yield names
    finally:
        for name in created:
            remove_namespace(name)
        for link in links:  # left in the root namespace only if moving it failed
            subprocess.run(["ip", "link", "del", link], capture_output=True)


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
