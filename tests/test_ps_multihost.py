"""The parameter server and two workers as separate hosts: Linux network namespaces joined by a bridge.

Each role runs in its own network namespace with its own address (server 10.77.0.1, workers
10.77.0.2 and .3) and its own loopback, so the run can only work over the veth links, the way it
would across machines. Processes are started through docker/entrypoint.sh, as the containers do.
Needs root and iproute2 (CI runs as root).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from src.metrics import read_events
from tests.ps_fixtures import ROOT, TOKEN, kill_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVER_IP, WORKER_IPS = "10.77.0.1", ("10.77.0.2", "10.77.0.3")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts():
    """Namespaces ``{server, worker_0, worker_1}``, with the server's bridge and a veth pair per worker."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (CI runs as root)")
    prefix = f"dts{os.getpid() % 100000}"
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
            bridge_end, host_end = f"{prefix}b{k}", f"{prefix}h{k}"
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
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for link in links:  # left in the root namespace only if moving it failed
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def start(namespace: str, environment: dict[str, str], args: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "DTS_AUTH_TOKEN": TOKEN, **environment}
    return subprocess.Popen(["ip", "netns", "exec", namespace, "bash", str(ROOT / "docker" / "entrypoint.sh"), *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_server_and_workers_on_separate_hosts(hosts, tmp_path):
    logs = tmp_path / "logs"
    processes = []
    outputs = {role: open(tmp_path / f"{role}.out", "w+") for role in hosts}
    try:
        processes.append(start(hosts["server"], {"DTS_ROLE": "server", "DTS_SERVER_ADDRESS": f"{SERVER_IP}:50051"},
                               ["--workers", "2", "--dataset", "mnist_5k", "--num-epochs", "1", "--max-train-samples", "256",
                                "--max-test-samples", "128", "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(logs / "server_host")],
                               outputs["server"]))
        for k in (0, 1):
            processes.append(start(hosts[f"worker_{k}"], {"DTS_ROLE": "worker", "DTS_WORKER_ID": str(k),
                                                          "DTS_SERVER_ADDRESS": f"{SERVER_IP}:50051"},
                                   ["--log-dir", str(logs / f"worker_host_{k}")], outputs[f"worker_{k}"]))
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

    assert "Final Accuracy:" in text["server"] and f"listening on {SERVER_IP}:50051" in text["server"]
    peers = sorted(event["peer"] for event in read_events(logs / "server_host" / "server" / "events.jsonl", kind="register"))
    assert [peer.rsplit(":", 1)[0] for peer in peers] == [f"ipv4:{address}" for address in WORKER_IPS]
    for k in (0, 1):
        assert f"worker {k}: 128 samples" in text[f"worker_{k}"]
        assert (logs / f"worker_host_{k}" / f"worker_{k}" / "events.jsonl").is_file()
    assert (tmp_path / "ckpt" / "parameter_server_final.pt").is_file()
