"""Virtual time with several server shards (src/virtual/follower.py, src/virtual/network.py, src/virtual/run.py).

Claims: the network rates transfers that cross several links max-min fairly (and is the server NIC's fair share
where a transfer crosses one shared link); each shard takes its byte share of the server's times; a virtual run with
2 shards trains as the virtual run with one server does (the same cores, the protocol's bytes), every shard holding
every version of the same pushes, and runs the same twice; in async a push too stale on one shard is rolled back
there alone; with the server NICs the bottleneck, 2 shards halve the step and the step is the BytePS formula's; with
compute the bottleneck, the step stays; what is not built for shards (faults, resume) is refused in one line, and
the runner takes ``--servers`` with ``--clock virtual``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.config import SetupError
from src.coordinator import check_coverage, check_shards
from src.emulation.cost_model import shard_times
from src.emulation.event_loop import EventLoop, SharedLink
from src.metrics import read_events
from src.ps.shards.final import shard_part_path
from src.virtual.network import FairNetwork
from src.virtual.run import VirtualRun, run_virtual
from tests.ps_fixtures import ps_config

pytestmark = pytest.mark.timeout(300)

WORKERS = 2
SAMPLES = 256  # 8 versions of 2 workers at batch 16
SHARDED = dict(
    system__clock="virtual",
    system__aggregation_mode="sync",
    system__num_workers=WORKERS,
    system__shard_slice_bytes=16384,  # simple_cnn's 1.6 MB classifier weight cut across the shards
    training__max_train_samples=SAMPLES,
)
COSTS = {"emulation__compute_s": 0.02, "emulation__server_update_s": 0.002, "emulation__server_reply_s": 0.001}
SERVER_MBPS = 50
LINK_BOUND = {
    "emulation__compute_s": 0.001,
    "emulation__server_update_s": 1e-5,
    "emulation__server_reply_s": 1e-5,
    "emulation__server_mbps": SERVER_MBPS,  # the workers' links: not limited
}
COMPUTE_BOUND = {"emulation__compute_s": 0.2, "emulation__server_update_s": 0.002, "emulation__server_reply_s": 0.001}


def config_of(folder: Path, name: str, shards: int, **fields):
    return ps_config(folder, name, system__num_servers=shards, **{**SHARDED, **fields})


def events(config, role: str, kind: str | None = None) -> list[dict]:
    return list(read_events(Path(config.system.log_dir) / role / "events.jsonl", kind))


def step_s(config) -> float:
    """Virtual seconds per sync step: the median time between shard 0's consecutive updates."""
    times = [e["time"] for e in events(config, "server", "update")]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


# ----------------------------------------------------------------------------- the pieces


def test_a_transfer_across_several_links_is_rated_max_min_fairly():
    # One shared link, each transfer also through a private one standing for its cap: SharedLink's fair share.
    ends: dict[str, dict[str, float]] = {"shared link": {}, "network": {}}
    loop = EventLoop()
    nic = SharedLink(loop, 100.0)
    done = ends["shared link"]
    nic.send(100.0, None, lambda: done.setdefault("a", loop.now))
    loop.at(0.5, lambda: nic.send(50.0, None, lambda: done.setdefault("b", loop.now)))
    loop.at(0.5, lambda: nic.send(20.0, 10.0, lambda: done.setdefault("c", loop.now)))
    loop.run(until=lambda: len(done) == 3)
    loop = EventLoop()
    network = FairNetwork(loop)
    shared, private = network.link(100.0), network.link(10.0)
    done = ends["network"]
    network.send(100.0, [shared], lambda: done.setdefault("a", loop.now))
    loop.at(0.5, lambda: network.send(50.0, [shared], lambda: done.setdefault("b", loop.now)))
    loop.at(0.5, lambda: network.send(20.0, [shared, private], lambda: done.setdefault("c", loop.now)))
    loop.run(until=lambda: len(done) == 3)
    assert ends["network"] == pytest.approx(ends["shared link"])
    assert ends["network"]["c"] == pytest.approx(2.5)

    # A worker's uplink (100 bit/s) carries two transfers at once, to two shards' NICs (60 bit/s each); another
    # worker's transfer shares the first NIC. That NIC is the bottleneck (30 each); the worker's second transfer takes
    # what its uplink leaves (70), capped by its own NIC (60): done at 100/60; then the first NIC's two at 30 each.
    loop = EventLoop()
    network = FairNetwork(loop)
    uplink, nic_a, nic_b, other = network.link(100.0), network.link(60.0), network.link(60.0), network.link(None)
    done = {}
    network.send(100.0, [uplink, nic_a], lambda: done.setdefault("to a", loop.now))
    network.send(100.0, [uplink, nic_b], lambda: done.setdefault("to b", loop.now))
    network.send(100.0, [other, nic_a], lambda: done.setdefault("other to a", loop.now))
    loop.run(until=lambda: len(done) == 3)
    assert done == pytest.approx({"to b": 100 / 60, "to a": 200 / 60, "other to a": 200 / 60})
    # Alone, the worker's two transfers share its uplink: both end when its 200 bits are through.
    loop = EventLoop()
    network = FairNetwork(loop)
    uplink, nic_a, nic_b = network.link(100.0), network.link(60.0), network.link(60.0)
    done = {}
    network.send(100.0, [uplink, nic_a], lambda: done.setdefault("to a", loop.now))
    network.send(100.0, [uplink, nic_b], lambda: done.setdefault("to b", loop.now))
    loop.at(0.5, lambda: network.set_capacity(uplink, 50.0))  # then the 75 bits each has left at 25 bit/s
    loop.run(until=lambda: len(done) == 2)
    assert done == pytest.approx({"to a": 3.5, "to b": 3.5})
    network.send(10.0, [network.link(None)], lambda: done.setdefault("unlimited", loop.now))
    loop.run(until=lambda: "unlimited" in done)
    assert done["unlimited"] == 3.5  # through at once


def test_each_shard_takes_its_byte_share_of_the_servers_times():
    times = shard_times(0.004, 0.002, [300, 100])
    assert [t.update_s for t in times] == pytest.approx([0.003, 0.001])
    assert [t.reply_s for t in times] == pytest.approx([0.0015, 0.0005])
    with pytest.raises(ValueError, match="no bytes"):
        shard_times(0.004, 0.002, [0, 0])


# ----------------------------------------------------------------------------- whole runs


@pytest.mark.slow
def test_two_virtual_shards_train_as_one_virtual_server_every_shard_alike_and_the_same_twice(tmp_path):
    """The same cores, the protocol's bytes: momentum SGD over 8 versions ends on the one server's parameters (to
    float32 rounding where a tensor is cut); every follower version is shard 0's, of the same pushes; every sample
    in exactly one update; the final checkpoint is the whole model, evaluated; each follower's part is written. Two
    runs of the same config give the same summary (folder names of one length: the config travels in messages), with
    each shard's load."""
    one = run_virtual(config_of(tmp_path / "a", "one", 1, training__momentum=0.9, **COSTS), tensorboard=False)
    configs = [config_of(tmp_path / folder, "two", 2, training__momentum=0.9, **COSTS) for folder in ("a", "b")]
    first, second = (run_virtual(config, tensorboard=False) for config in configs)

    cut = [key for keys in first["placement"]["slices_per_shard"] for key in keys if "#" in key]
    assert cut, "the test should cut a tensor across the shards"
    assert first["versions"] == one["versions"] == 8 and first["samples_processed"] == SAMPLES
    whole, reference = (load_checkpoint(s["checkpoint_path"])["model_state_dict"] for s in (first, one))
    assert whole.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(whole[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert first["final_accuracy"] == one["final_accuracy"]
    assert first["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)

    config = configs[0]
    server = events(config, "server")
    assert check_shards(server, {1: events(config, "server_1")})["ok"]
    assert check_coverage(server, SAMPLES, 1)["ok"]
    [whole_model] = events(config, "server", "whole_model")
    assert whole_model["version"] == 8 and whole_model["final_accuracy"] == first["final_accuracy"]
    # Each shard's load: the Push and Pull bytes it took in and sent out are the workers' (less register, heartbeats
    # and finish, a few hundred bytes); each held push cost it its byte share of server_update_s.
    shards = first["shards"]
    assert [s["bytes_placed"] for s in shards] == first["placement"]["bytes_per_shard"]
    assert 0.999 * first["bytes_sent"] <= sum(s["bytes_in"] for s in shards) <= first["bytes_sent"]
    assert 0.999 * first["bytes_received"] <= sum(s["bytes_out"] for s in shards) <= first["bytes_received"]
    held = SAMPLES // 16  # one held push per batch, on every shard
    shares = [s["bytes_placed"] / sum(first["placement"]["bytes_per_shard"]) for s in shards]
    assert [s["update_s"] for s in shards] == pytest.approx([held * 0.002 * share for share in shares], abs=1e-6)
    part = load_checkpoint(shard_part_path(config.system.checkpoint_dir, 1))
    assert part["extra"] == {"shard": 1, "version": 8}
    assert sorted(part["model_state_dict"]) == sorted(first["placement"]["slices_per_shard"][1])

    wall = set(first["wall_time_fields"])
    strip = lambda summary: json.loads(  # noqa: E731
        json.dumps({k: v for k, v in summary.items() if k not in wall})
        .replace(str(tmp_path / "a"), "ROOT")
        .replace(str(tmp_path / "b"), "ROOT")
    )
    assert strip(first) == strip(second)
    assert first["train_time_s"] == second["train_time_s"] and first["total_time_s"] == second["total_time_s"]


@pytest.mark.slow
def test_async_over_two_virtual_shards_every_shard_alike_and_the_same_twice(tmp_path):
    """Async (3 workers with uneven compute, so pushes are stale and the soft policy weighs them): every push is a
    version on every shard, of the same push (src/ps/shards/asynchronous.py), every sample in exactly one update, and
    the run is deterministic."""
    fields = dict(
        system__aggregation_mode="async",
        system__num_workers=3,
        system__staleness_policy="soft",
        emulation__workers={2: {"slowdown": 3.0}},
        training__momentum=0.9,
        **COSTS,
    )
    configs = [config_of(tmp_path / folder, "async", 2, **fields) for folder in ("a", "b")]
    first, second = (run_virtual(config, tensorboard=False) for config in configs)
    server = events(configs[0], "server")
    assert first["samples_processed"] == SAMPLES and first["max_staleness"] >= 1
    assert check_shards(server, {1: events(configs[0], "server_1")})["ok"]
    assert check_coverage(server, SAMPLES, 1)["ok"]
    stale = [e for e in events(configs[0], "server_1", "hold") if e["staleness"] > 0]
    assert stale and all(e["weight"] == pytest.approx(1 / (1 + 0.5 * e["staleness"])) for e in stale)
    for key in ("versions", "final_accuracy", "final_loss", "max_staleness", "train_time_s"):
        assert first[key] == second[key], key


@pytest.mark.slow
def test_async_a_push_too_stale_on_one_shard_is_rolled_back_there_alone_and_coverage_stays_exact(tmp_path):
    """Rollback per slice in a whole run (3 workers, one twice as slow, max_staleness 0): shard 0 judges every
    shard's staleness, and pushes too stale on shard 0 alone, on the follower alone, and on both occur. The first two
    are applied on the other shard and pass the version unchanged on that one (the follower's update event says so,
    weight 0); the last are rejected whole. Every version is the same push on both shards, and every sample is in
    exactly one applied update."""
    config = config_of(
        tmp_path,
        "a",
        2,
        system__aggregation_mode="async",
        system__num_workers=3,
        system__staleness_policy="hard",
        system__max_staleness=0,
        emulation__workers={2: {"slowdown": 2.0}},
        training__momentum=0.9,
        **COSTS,
    )
    summary = run_virtual(config, tensorboard=False)
    pushes = events(config, "server", "push")
    rolled = [tuple(e["rolled_back"]) for e in pushes if e.get("rolled_back")]
    assert set(rolled) == {(0,), (1,)} and all(e["accepted"] for e in pushes if e.get("rolled_back"))
    assert summary["pushes_rejected"] > 0
    assert [s["rolled_back"] for s in summary["shards"]] == [rolled.count((0,)), rolled.count((1,))]
    assert summary["pushes_applied"] == summary["versions"] == sum(1 for e in pushes if e["accepted"])
    updates = {e["version"]: e for e in events(config, "server_1", "update")}
    passed = [v for v, e in updates.items() if e.get("rolled_back")]
    assert len(passed) == rolled.count((1,)) and all(updates[v]["weight"] == 0.0 for v in passed)
    assert len([e for e in events(config, "server", "update") if e.get("rolled_back")]) == rolled.count((0,))
    server = events(config, "server")
    assert check_shards(server, {1: events(config, "server_1")})["ok"]
    assert summary["samples_processed"] == SAMPLES and check_coverage(server, SAMPLES, 1)["ok"]


@pytest.fixture(scope="module")
def link_bound(tmp_path_factory) -> dict[int, object]:
    """The link-bound runs, with 1 and 2 shards: each worker's slices cross its shard's NIC at 50 Mbit/s."""
    folder = tmp_path_factory.mktemp("link_bound")
    configs = {shards: config_of(folder, f"s{shards}", shards, **LINK_BOUND) for shards in (1, 2)}
    for config in configs.values():
        run_virtual(config, tensorboard=False)
    return configs


@pytest.mark.slow
def test_with_the_server_nics_the_bottleneck_two_shards_halve_the_step(link_bound, tmp_path):
    """Link-bound: a step is ~2 n M / (S B) (every worker's push into the NICs, then every pull out of them), compute
    and the server's times ~0.1% of it, so the ratio is 1/2 times the heaviest shard's share over the mean (1.004
    for simple_cnn in 16 kB slices), plus the messages that do not split (commit, pulls, acknowledgements: a few
    hundred bytes): 0.45-0.65 leaves room for both and fails where the shards' NICs are not each the worker's own
    (ratio 1). Compute-bound (no NIC limit): only the servers' times split, (u + r) n / S of a 0.2 s compute step."""
    link_ratio = step_s(link_bound[2]) / step_s(link_bound[1])
    assert 0.45 <= link_ratio <= 0.65, link_ratio
    compute = [config_of(tmp_path, f"c{shards}", shards, **COMPUTE_BOUND) for shards in (1, 2)]
    for config in compute:
        run_virtual(config, tensorboard=False)
    compute_ratio = step_s(compute[1]) / step_s(compute[0])
    assert 0.95 <= compute_ratio < 1.0, compute_ratio


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2])
def test_a_link_bound_step_takes_what_the_byteps_formula_says(link_bound, shards):
    """BytePS's time for a non-colocated PS, per direction: max(M / B_worker, n M / (k B_server)) for n workers
    and k server shards, M the bytes a worker moves that way per step (its push, the exact serialized sizes of the
    holds, the commit and the pull requests; its replies). Both directions are crossed in turn, then compute."""
    config = link_bound[shards]
    steady = events(config, "worker_0", "push")[1:]
    push_bytes = statistics.median(e["push_bytes"] for e in steady)
    reply_bytes = statistics.median(e["reply_bytes"] for e in steady)
    server_bps, worker_bps = SERVER_MBPS * 1e6, float("inf")  # the workers' links are not limited
    one_way = lambda m: max(8 * m / worker_bps, WORKERS * 8 * m / (shards * server_bps))  # noqa: E731
    formula = one_way(push_bytes) + one_way(reply_bytes) + LINK_BOUND["emulation__compute_s"]
    assert step_s(config) == pytest.approx(formula, rel=0.10), (step_s(config), formula)


# ----------------------------------------------------------------------------- refusals and the runner


def test_what_is_not_built_for_shards_is_refused_in_one_line_before_anything_is_measured(tmp_path, capsys):
    faulty = config_of(tmp_path, "faulty", 2, system__inject_faults=["kill:worker=0@step=2"])  # no cost figures
    with pytest.raises(SetupError, match=r"^system.inject_faults: not with system.num_servers = 2 in virtual time"):
        run_virtual(faulty, tensorboard=False)
    assert "measuring" not in capsys.readouterr().err
    with pytest.raises(SetupError, match=r"^--resume: not with system.num_servers = 2 yet"):
        VirtualRun(config_of(tmp_path, "resumed", 2, **COSTS), resume=tmp_path / "nowhere")


def test_the_runner_takes_servers_with_the_virtual_clock():
    import run_parameter_server_training as runner  # the root runner (pytest puts the root on sys.path)

    parser = runner.build_parser()
    args = parser.parse_args(["--clock", "virtual", "--servers", "2", "--aggregation-mode", "sync"])
    config = runner.checked_config(parser, args)
    assert (config.system.clock, config.system.num_servers) == ("virtual", 2)
    resumed = parser.parse_args(["--clock", "virtual", "--servers", "2", "--aggregation-mode", "sync", "--resume", "x"])
    with pytest.raises(SystemExit):
        runner.checked_config(parser, resumed)
