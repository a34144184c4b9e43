"""``scripts/bench_ps.py``'s server-shard sections: ``shards`` (one server against 2 shards on loopback) runs and
prints its section, each of 2 shards carrying half of one server's bytes; ``shards_netns`` says why it did not run
where it cannot (never a number); its hosts shape a server's link both ways and leave no namespace behind; the
suite tables both figures beside their references."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from src.benchmarks import suite
from src.benchmarks.ps import netns
from tests.ps_fixtures import ROOT, run_process


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_shards_section_runs_and_two_shards_each_carry_half_of_one_servers_bytes():
    done = run_process(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_ps.py"),
            *"--skip-round-trips --skip-ceiling --skip-training --skip-netns --transports tcp".split(),
            *"--shards-seconds 0.5 --shards-repeats 1".split(),
        ],
        cwd=ROOT,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = suite.last_json_document(done.stdout)
    assert "shards_netns" not in result and "round_trips" not in result and "ceiling" not in result
    [entry] = result["shards"]
    one, one_sharded, two = entry["rows"]
    assert [(r["servers"], r["step"]) for r in entry["rows"]] == [
        (1, "push"),
        (1, "hold + commit + pull"),
        (2, "hold + commit + pull"),
    ]
    for row in entry["rows"]:
        assert row["steps_per_client"] > 0 and row["pushes_per_s"] > 0 and row["clients"] == 4
        assert row["pushes_per_s"] == pytest.approx(4 * row["steps_per_client"] / row["seconds"], rel=0.02)
        # what the clients sent is what the shards counted in (their Push and Pull messages: the frames' headers aside)
        assert sum(s["gb_per_s_in"] for s in row["shards"]) == pytest.approx(row["gb_per_s_in"], rel=0.02, abs=0.002)
    whole = one["shards"][0]["bytes_in_per_push"]
    assert whole > 4 * 2**20 and one_sharded["shards"][0]["bytes_in_per_push"] == pytest.approx(whole, rel=0.01)
    assert [s["role"] for s in two["shards"]] == ["shard 0 (parameter server)", "follower"]
    for shard in two["shards"]:  # 4 of the 8 tensors each, in and out
        assert shard["bytes_in_per_push"] == pytest.approx(whole / 2, rel=0.01)
        assert shard["bytes_out_per_push"] == pytest.approx(whole / 2, rel=0.01)
    assert entry["ratio_to_one_server"] == pytest.approx(two["pushes_per_s"] / one["pushes_per_s"], abs=0.001)
    assert "shards tcp S=2 (hold + commit + pull, run 1)" in done.stderr


def test_the_netns_section_says_why_it_did_not_run_and_holds_no_figure(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    section = netns.bench_shards_netns(50)
    assert section["skipped"] == "network namespaces and tc need root"
    assert set(section) == {"skipped", "setup"} and "50 Mbit/s" in section["setup"]
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert netns.bench_shards_netns(50)["skipped"] == "needs iproute2 (tc not found)"


def test_a_runs_traces_are_kept_per_side_and_role(tmp_path):
    """--netns-trace-dir: each process's trace of a real run (``ROLE/logs/...``) and of its virtual run
    (``virtual/logs/ROLE/``) is copied to ``real/ROLE/`` and ``virtual/ROLE/``; nothing else is."""
    run = tmp_path / "run"
    written = [
        "server_0/logs/server/trace.json",
        "server_1/logs/server_1/trace.json",
        "worker_1/logs/worker_1/trace.json",
        "virtual/logs/server/trace.json",
        "virtual/logs/worker_0/trace.json",
        "server_0/logs/server/events.jsonl",
    ]
    for path in written:
        (run / path).parent.mkdir(parents=True, exist_ok=True)
        (run / path).write_text(path)
    netns._keep_traces(run, tmp_path / "kept")
    kept = {str(p.relative_to(tmp_path / "kept")): p.read_text() for p in (tmp_path / "kept").rglob("*") if p.is_file()}
    assert kept == {
        "real/server_0/trace.json": written[0],
        "real/server_1/trace.json": written[1],
        "real/worker_1/trace.json": written[2],
        "virtual/server/trace.json": written[3],
        "virtual/worker_0/trace.json": written[4],
    }


def test_the_suite_tables_both_shard_figures_beside_their_references():
    shards = {
        "transport": "tcp",
        "model_mb": 4,
        "rows": [
            {"servers": 1, "clients": 4, "pushes_per_s": 200.0},
            {"servers": 1, "clients": 4, "pushes_per_s": 150.0},
            {"servers": 2, "clients": 4, "pushes_per_s": 160.0},
        ],
        "ratio_to_one_server": 0.8,
    }
    measured = {
        "link_mbps": 50,
        "one_shard": {"samples_per_s": 30.0},
        "two_shards": {"samples_per_s": 56.0},
        "ratio": 1.867,
        "target_ratio": 1.8,
    }
    loopback, hosts = suite.figures_ps({"shards": [shards], "shards_netns": measured})
    assert (loopback["ours"], loopback["reference"], loopback["ratio"]) == (160.0, 200.0, 0.8)
    assert loopback["meets_target"] is None and "2 server shards" in loopback["figure"]
    assert (hosts["ours"], hosts["reference"], hosts["ratio"], hosts["target"]) == (56.0, 30.0, 1.867, 1.8)
    assert hosts["meets_target"] is True and "50 Mbit/s" in hosts["figure"]
    [below] = suite.figures_ps({"shards_netns": {**measured, "ratio": 1.6}})
    assert below["meets_target"] is False
    [skipped] = suite.figures_ps({"shards_netns": {"skipped": "network namespaces and tc need root", "setup": ""}})
    assert skipped["ours"] is None and skipped["ratio"] is None
    assert skipped["target_text"] == "network namespaces and tc need root"


# ----------------------------------------------------------------------------- the hosts, for real

RECEIVE = """
import socket, sys, time
listener = socket.create_server((sys.argv[1], 5001))
print("listening", flush=True)
connection, _ = listener.accept()
first = connection.recv(1 << 16)
started, total = time.perf_counter(), len(first)
while chunk := connection.recv(1 << 16):
    total += len(chunk)
print(total - len(first), time.perf_counter() - started, flush=True)
"""
SEND = """
import socket, sys
connection = socket.create_connection((sys.argv[1], 5001), timeout=30)
connection.sendall(bytes(int(sys.argv[2])))
connection.close()
"""
SHAPED_MBPS = 20
BYTES = 2_500_000  # 1 s at 20 Mbit/s


def _mbps(hosts: netns.Hosts, sender: str, receiver: str) -> float:
    """Mbit/s of ``BYTES`` sent from host ``sender`` to host ``receiver`` over a plain TCP connection."""
    address = hosts.ips[receiver]
    receiving = subprocess.Popen(
        ["ip", "netns", "exec", hosts.namespaces[receiver], sys.executable, "-c", RECEIVE, address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiving.stdout.readline().strip() == "listening"  # waits for the listener (or its death: "")
        subprocess.run(
            ["ip", "netns", "exec", hosts.namespaces[sender], sys.executable, "-c", SEND, address, str(BYTES)],
            check=True,
            timeout=60,
        )
        counted, seconds = receiving.communicate(timeout=60)[0].split()
    finally:
        if receiving.poll() is None:
            receiving.kill()
            receiving.wait()
    return int(counted) * 8 / float(seconds) / 1e6


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(120)
def test_a_servers_link_is_shaped_both_ways_and_the_hosts_are_removed_after():
    if netns.unavailable():
        pytest.skip(netns.unavailable())
    roles = ["server_0", "worker_0", "worker_1"]
    with netns.Hosts(roles, ["server_0"], SHAPED_MBPS) as hosts:
        names = list(hosts.namespaces.values()) + [hosts.switch]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert all(name in listed for name in names), listed
        into_server = _mbps(hosts, "worker_0", "server_0")  # shaped on the bridge's end of the server's link
        out_of_server = _mbps(hosts, "server_0", "worker_1")  # shaped on the server's own end
        between_workers = _mbps(hosts, "worker_0", "worker_1")  # no shaped link on the way
    for rate in (into_server, out_of_server):
        assert SHAPED_MBPS * 0.8 < rate < SHAPED_MBPS * 1.25, (into_server, out_of_server)
    assert between_workers > 5 * SHAPED_MBPS, between_workers
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed.split() for name in names), listed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not re.search(rf"\b{hosts.prefix}[ph]\d", links), links


@pytest.mark.alone
@pytest.mark.timeout(60)
def test_hosts_that_fail_to_build_remove_what_they_made_and_only_that():
    if netns.unavailable():
        pytest.skip(netns.unavailable())
    hosts = netns.Hosts(["server_0", "worker_0"], ["server_0"], SHAPED_MBPS)
    taken = hosts.namespaces["worker_0"]  # the last namespace it makes: the switch and server_0's come first
    subprocess.run(["ip", "netns", "add", taken], check=True)
    try:
        with pytest.raises(RuntimeError, match=f"ip netns add {taken}"):
            with hosts:
                pass
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert [name for name in listed if name.startswith(hosts.prefix)] == [taken]
    finally:
        netns.remove_namespace(taken)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_crossover_bench_follows_its_formula_where_the_link_dominates():
    """bench (c) on its smallest case: 4 workers, 1 and 2 shards on 1 Gbit/s, and DDP: the virtual PS step is our
    formula's within 10% (the server's few ms aside), 2 shards nearly halve it, BytePS's overlapped formula is
    half of ours, and DDP's step is the ring formula's less at most the compute it overlaps. With pipelined
    replies (on 1 shard) the push and the pull overlap, and the step is BytePS's formula's within 3% (the
    shard's NIC binds here: n M / (k B))."""
    from src.benchmarks.ps.crossover import COMPUTE_S, bench_crossover, ps_step

    result = bench_crossover([4], [1, 2], [1000], pipelined_max_workers=0)
    one, two = result["rows"]
    one["pipelined_ratio_to_byteps"] = ps_step(4, 1, 1000, pipelined=True)["pipelined_ratio_to_byteps"]
    assert all(abs(row["ratio_to_formula"] - 1) < 0.1 for row in (one, two)), result["rows"]
    assert 0.45 < two["ps_step_s"] / one["ps_step_s"] < 0.6
    assert one["byteps_formula_s"] < 0.55 * one["ours_formula_s"]
    # DDP's buckets go while backward computes the ones before them: the overlap hides at most the compute
    assert one["allreduce_formula_s"] - COMPUTE_S < one["ddp_step_s"] < one["allreduce_formula_s"]
    assert abs(one["pipelined_ratio_to_byteps"] - 1) < 0.03, one
    assert result["crossover"] == [
        {
            "mbps": 1000,
            "workers": 4,
            "fewest_shards_beating_ddp": None,
            "fewest_shards_beating_ddp_byteps": None,
            "fewest_shards_beating_ddp_pipelined": "not measured",
        }
    ]
