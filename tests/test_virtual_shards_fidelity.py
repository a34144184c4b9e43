"""Virtual time against a real run on 2 server shards (issue 33): the same sync experiment run for real across
network namespaces, each shard's link shaped by ``tc``, and in virtual time with the cost model calibrated here.

The real run is ``scripts/bench_ps.py``'s across-hosts run (:func:`src.benchmarks.ps.netns.run_across_hosts`): each
shard and each worker the runner in a namespace of its own on one bridge; each shard's link limited to 50 Mbit/s
both ways by a ``tbf`` qdisc on its two ends, the workers' links not limited. The virtual run is the same config (the
one the real shard 0 ran, from its final checkpoint) with what virtual time models of that setting: each shard's NIC
at ``server_mbps`` = the tc rate each way, the workers' links not limited, and compute and the server's times
measured on this machine (:func:`src.studies.fidelity.compare_with_real`).

Link-bound: each step moves every worker's gradient into the shards and the parameters back out, 1.7 MB each way per
shard at 50 Mbit/s, about 0.55 s; compute and the servers' work are a few percent of it. That is what makes the ratio
stable under CI load: the links do not slow down when the cores are busy. What virtual time leaves out here (measured:
``docs/virtual_time.md``) is the TCP/IP headers that ``tbf`` counts with the payload, 66 bytes per 1448-byte segment
(4.6% more link time), and TCP's uneven sharing, which wins some of it back: a few percent, far inside the 15% the
issue asks for.

``python -m pytest -q -s -n 0 tests/test_virtual_shards_fidelity.py`` prints the comparison (the record in
``docs/virtual_time.md``). And a sharded virtual run without cost figures measures them here: one server's, over the
run's transport (:mod:`src.virtual.calibration`), which each shard takes its byte share of.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from src.benchmarks.ps import netns
from src.common.checkpoint import load_checkpoint
from src.config import validate_config
from src.studies.fidelity import compare_with_real
from src.virtual.run import run_virtual
from tests.ps_fixtures import ps_config

pytestmark = pytest.mark.timeout(300)

MBPS = 50
SETTINGS = {"samples": 512, "batch_size": 16, "slice_bytes": 65536, "transport": "tcp"}
"""16 sync versions of 2 workers (simple_cnn, 1.7 MB a push, cut in 64 kB slices across the 2 shards): ~9 s of
training for real, the whole test ~25 s on a quiet machine."""
ROLES = ["server_0", "server_1", *(f"worker_{k}" for k in range(netns.NUM_WORKERS))]


@pytest.mark.slow
@pytest.mark.alone  # namespaces, and a real run's seconds
def test_virtual_time_matches_a_real_two_shard_run_behind_tc_shaped_links(tmp_path):
    """Samples/s within 15% of the real run's; the same updates (sync, the same seed): the same number of versions
    and the same final parameters to float32 rounding (the real workers compute on one thread each, the virtual
    ones on this process's), the same accuracy."""
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)  # CI runs as root with iproute2
    real_folder = tmp_path / "real"
    real_folder.mkdir()
    with netns.Hosts(ROLES, ["server_0", "server_1"], MBPS) as hosts:
        real = netns.run_across_hosts(hosts, 2, real_folder, SETTINGS, netns.PORT, os.urandom(16).hex())
    assert real["followers_exit"] == {"server_1": 0}, real["followers_exit"]
    real_checkpoint = load_checkpoint(real["checkpoint_path"])
    config = validate_config(real_checkpoint["config"])
    assert (config.system.num_servers, config.system.aggregation_mode) == (2, "sync")

    virtual_folder = tmp_path / "virtual"
    result = compare_with_real(config, real, virtual_folder, setting={"server_mbps": MBPS})
    virtual = result.pop("virtual_summary")
    link_s = (real["bytes_sent"] + real["bytes_received"]) * 8 / (2 * MBPS * 1e6)  # the bytes over the 2 shards' links
    record = {
        "setup": f"simple_cnn, mnist_5k, {SETTINGS}, 2 sync workers, 2 shards, each shard's link tc tbf {MBPS} Mbit/s "
        "both ways, workers' links not shaped; virtual: server_mbps = the tc rate, calibrated here",
        **{key: result[key] for key in ("throughput_samples_per_s_ratio", "train_time_s_ratio", "calibration")},
        "real": result["real"][0],
        "virtual": result["virtual"][0],
        "real_link_share": round(link_s / real["train_time_s"], 3),
        "step_s": {
            "real": round(netns.steady_step_s(Path(config.system.log_dir)), 4),
            "virtual": round(netns.steady_step_s(virtual_folder / "logs"), 4),
        },
    }
    record["step_ratio"] = round(record["step_s"]["virtual"] / record["step_s"]["real"], 3)
    whole = load_checkpoint(virtual["checkpoint_path"])["model_state_dict"]
    parameters = real_checkpoint["model_state_dict"]
    record["parameters_max_abs_difference"] = max(
        (whole[name].float() - value.float()).abs().max().item() for name, value in parameters.items()
    )
    print(json.dumps(record, indent=1))

    ratio = result["throughput_samples_per_s_ratio"]
    assert ratio == pytest.approx(1.0, abs=0.15), f"virtual / real samples/s = {ratio:.3f}: {json.dumps(record)}"
    assert record["real_link_share"] > 0.7, record  # the regime the bound is for: the links set the step
    (real_figures,), (virtual_figures,) = result["real"], result["virtual"]
    assert real_figures["versions"] == virtual_figures["versions"] == SETTINGS["samples"] // 32
    assert abs(real_figures["final_accuracy"] - virtual_figures["final_accuracy"]) <= 0.01, record
    for name, value in parameters.items():
        torch.testing.assert_close(whole[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(120)
def test_a_sharded_virtual_run_without_cost_figures_measures_one_servers_over_the_runs_transport(tmp_path, capsys):
    """The figures each shard takes its byte share of are one server's, measured over the config's transport (a
    sharded config once had its calibration server refuse the unsharded push, a TCP one a gRPC client, and a pipelined
    one its own async config: pipelined replies are sync's only). Streamed, with pipelined replies."""
    config = ps_config(
        tmp_path,
        "measured",
        system__clock="virtual",
        system__aggregation_mode="sync",
        system__num_workers=2,
        system__num_servers=2,
        system__shard_slice_bytes=65536,
        system__transport="tcp",
        system__streaming=True,
        system__pipelined_replies=True,
    )
    summary = run_virtual(config, tensorboard=False)
    assert "not in the config; measuring them on this machine" in capsys.readouterr().err
    cost = summary["cost_model"]
    assert cost["measured_here"] == ["compute_s", "server_reply_s", "server_update_s"]
    assert cost["server_update_s"] > 0 and cost["server_reply_s"] > 0
    shares = [b / sum(summary["placement"]["bytes_per_shard"]) for b in summary["placement"]["bytes_per_shard"]]
    assert cost["per_shard"]["update_s"] == pytest.approx([cost["server_update_s"] * share for share in shares])
    assert summary["versions"] == 2 and summary["samples_processed"] == 64
    assert summary["pipelined_replies"]["slices_confirmed"] > 0, summary["pipelined_replies"]
