"""The findings: their matrices' configs, the committed results, docs/findings.md, and what feeds them.

Claims: every findings matrix is valid, seed first, with an A/A arm and >= 8 seeds; docs/findings.md
holds exactly what scripts/findings.py computes from the committed records (a changed number fails
the check); a matrix run, collected, gives the figures (sync and async scored at the same sample
counts); a sharded sync run's accuracy curve is the one-server run's at its own times (F13); a mid-run uplink
change slows the pushes after it; Fashion-MNIST and CIFAR-10 files in torchvision's layouts train.
"""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from scripts import findings as findings_script  # a script: scripts/ is a namespace package under the root
from src.config import ConfigError, validate_config
from src.emulation.cost_model import CostModel
from src.findings import figures as findings
from src.findings.document import check_document
from src.findings.record import collect_matrix, load_records, write_record
from src.findings.render import render
from src.findings.sharded_ps import sharded_curve
from src.launch import experiment as rx
from src.launch import matrix as run_matrix
from src.virtual.run import run_virtual
from tests.ps_fixtures import ROOT, ps_config

pytestmark = pytest.mark.timeout(120)

FINDINGS_CONFIGS = sorted((ROOT / "configs" / "experiments").glob("f[0-9]*.yaml"))
REALTIME_CONFIGS = sorted((ROOT / "configs" / "experiments").glob("realtime_*.yaml"))
RECORDS = ROOT / "docs" / "findings"
DOC = ROOT / "docs" / "findings.md"
COSTS = {"compute_s": 0.01, "server_update_s": 0.002, "server_reply_s": 0.002}


@pytest.mark.parametrize("path", FINDINGS_CONFIGS, ids=lambda p: p.stem)
def test_a_findings_matrix_is_valid_seed_first_with_an_aa_arm_and_eight_seeds(path, tmp_path):
    data = yaml.safe_load(path.read_text())
    axes = data["matrix"]["axes"]
    assert list(axes)[0] == "seed" and len(axes["seed"]) >= 8  # configurations alternate within each seed
    arms = next(
        levels for name, levels in axes.items() if name != "seed" and any(label.endswith("_aa") for label in levels)
    )
    for label, overrides in arms.items():
        if label.endswith("_aa"):
            assert overrides in [v for k, v in arms.items() if k != label]  # the A/A arm repeats another arm exactly
    assert data["system"]["clock"] == "virtual"
    name, runs = run_matrix.expand(data, path.stem)
    assert name == path.stem and [e["name"].split("__")[0] for e, _ in runs[:2]] == ["seed-0", "seed-0"]
    for experiment, run_data in runs:
        rx.build_config(experiment, run_data, tmp_path / experiment["name"])  # every run validates


@pytest.mark.parametrize("path", REALTIME_CONFIGS, ids=lambda p: p.stem)
def test_a_realtime_confirmation_is_valid_and_on_the_real_clock(path, tmp_path):
    data = yaml.safe_load(path.read_text())
    assert list(data["matrix"]["axes"])[0] == "seed" and data["system"]["clock"] == "real"
    for experiment, run_data in run_matrix.expand(data, path.stem)[1]:
        rx.build_config(experiment, run_data, tmp_path / experiment["name"])


def test_the_document_holds_exactly_what_the_committed_records_give(tmp_path):
    records = load_records(RECORDS)
    assert set(findings.MATRICES) <= set(records), "a findings matrix has no committed record"
    assert sum(path.stat().st_size for path in RECORDS.glob("*.json")) < 20e6
    blocks = render(findings.compute(records))
    text = DOC.read_text()
    assert check_document(text, blocks) == []
    assert set(findings.REALTIME) <= set(records), "a real-time confirmation has no committed record"
    for name in findings.MATRICES:
        record = records[name]
        assert len({run["seed"] for run in record["runs"]}) >= 8
        assert all(run["experiment"]["clock"] == "virtual" and run["experiment"]["commit"] for run in record["runs"])
    # the script says so too, and fails when a number in a block is not the computed one
    assert findings_script.main(["--check"]) == 0
    begin = text.index("<!-- findings:F1 -->")
    digit = next(i for i in range(begin, len(text)) if text[i].isdigit() and text[i - 1] == " ")
    changed = tmp_path / "findings.md"
    changed.write_text(text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1 :])
    assert findings_script.main(["--check", "--doc", str(changed)]) == 1
    missing = check_document("no blocks", blocks)
    assert (
        len(missing) == len(blocks)
        and "block summary: missing (markers <!-- findings:summary --> ... <!-- /findings:summary -->)" in missing
    )


def test_the_committed_aa_arms_differ_by_exactly_nothing():
    figures = findings.compute(load_records(RECORDS))
    for level in figures["F1"].values():
        assert level["aa"]["final_accuracy_difference"]["values"] == [0.0] * level["seeds"]
    assert set(figures["F8_F9_F10"]["aa"]["time_to_target_ratio"]["values"]) <= {1.0}
    for optimizer in ("sgd", "momentum"):
        assert set(figures["F2_F4_F5_F6"][optimizer]["aa"]["accuracy_difference"]["values"]) == {0.0}
    assert figures["F13"]["aa"]["throughput_ratio"]["values"] == [1.0] * figures["F13"]["seeds"]
    assert set(figures["F13"]["aa"]["final_accuracy_difference"]["values"]) == {0.0}
    assert set(figures["F13"]["same_update"].values()) == {f"{figures['F13']['seeds']}/{figures['F13']['seeds']}"}


def _tiny_matrix(tmp_path: Path) -> Path:
    matrix = {
        "matrix": {
            "name": "f1_stragglers",
            "axes": {
                "seed": [0, 1],
                "setup": {
                    "sync": {"system.aggregation_mode": "sync"},
                    "async_plain": {"system.aggregation_mode": "async", "system.async_correction": "none"},
                    "sync_aa": {"system.aggregation_mode": "sync"},
                },
            },
        },
        "training": {
            "dataset": "mnist_5k",
            "max_train_samples": 96,
            "max_test_samples": 64,
            "batch_size": 8,
            "num_epochs": 1,
            "momentum": 0.0,
            "eval_every_samples": 48,
            "target_accuracy": 0.2,
        },
        "system": {"num_workers": 3, "clock": "virtual"},
        "emulation": {"workers": {1: {"step_delay_s": 0.3}}, **COSTS},
        "metrics": {"trackers": []},
    }
    path = tmp_path / "f1_stragglers.yaml"
    path.write_text(yaml.safe_dump(matrix, sort_keys=False))
    return path


def test_a_matrix_run_collected_gives_its_figures_at_the_same_sample_counts(tmp_path):
    threads = torch.get_num_threads()
    try:
        args = ["--config", str(_tiny_matrix(tmp_path)), "--results-dir", str(tmp_path / "results"), "--threads", "1"]
        assert run_matrix.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # --threads sets this process's count
    record = collect_matrix(tmp_path / "results" / "f1_stragglers")
    assert [(r["seed"], r["configuration"]) for r in record["runs"]] == [
        (0, "sync"),
        (0, "async_plain"),
        (0, "sync_aa"),
        (1, "sync"),
        (1, "async_plain"),
        (1, "sync_aa"),
    ]  # seed outer
    counts = {
        r["configuration"]: [e[0] for e in r["evals"] if e[0] % 48 == 0] for r in record["runs"] if r["seed"] == 0
    }
    assert counts["sync"] == counts["async_plain"] == [48, 96, 96]  # every 48 samples, then the final evaluation
    run = record["runs"][0]
    assert run["experiment"]["clock"] == "virtual" and len(run["experiment"]["commit"]) == 40
    assert run["experiment"]["torch_threads"] == 1  # the count the records are reproduced at
    assert "log_dir" not in run["config"]["system"] and set(run["summary"]["workers"][0]) >= {
        "samples",
        "gradient_time_s",
    }
    path = write_record(record, tmp_path / "records")
    assert path.stat().st_size < 100_000 and json.loads(path.read_text())["runs"][0] == run
    level = findings.compute(load_records(tmp_path / "records"))["F1"]["3"]
    plain = level["async_plain"]
    # worker 1 waits 0.3 s a step, the others ~0.014 s: async is several times faster (12 pushes: end effects)
    assert plain["throughput_ratio"]["mean"] > 2 and 0.5 < plain["fraction_of_ideal"]["mean"] <= 1.05
    assert level["aa"]["throughput_ratio"]["values"] == [1.0, 1.0]
    assert "A/A (sync repeated): samples/s ratio 1.000x" in render(findings.compute({"f1_stragglers": record}))["F1"]


def _tiny_f13(tmp_path: Path) -> Path:
    matrix = {
        "matrix": {
            "name": "f13_shards",
            "axes": {
                "seed": [0, 1],
                "arm": {
                    "ddp": {"system.architecture": "ddp"},
                    "sync_k1": {"system.num_servers": 1},
                    "sync_k2": {"system.num_servers": 2},
                    "async_k1": {"system.aggregation_mode": "async"},
                    "ddp_aa": {"system.architecture": "ddp"},
                },
            },
        },
        "training": {
            "dataset": "mnist_5k",
            "model_architecture": "mlp",
            "max_train_samples": 96,
            "max_test_samples": 64,
            "batch_size": 8,
            "num_epochs": 1,
            "eval_every_samples": 48,
        },
        "system": {"num_workers": 3, "clock": "virtual", "aggregation_mode": "sync", "shard_slice_bytes": 65536},
        "emulation": {"uplink_mbps": 100, "downlink_mbps": 100, "server_mbps": 100, **COSTS},
        "metrics": {"trackers": []},
    }
    path = tmp_path / "f13_shards.yaml"
    path.write_text(yaml.safe_dump(matrix, sort_keys=False))
    return path


def test_f13_a_sharded_run_takes_the_one_server_runs_curve_at_its_own_times(tmp_path):
    assert run_matrix.main(["--config", str(_tiny_f13(tmp_path)), "--results-dir", str(tmp_path / "results")]) == 0
    record = collect_matrix(tmp_path / "results" / "f13_shards")
    runs = {(r["configuration"], r["seed"]): r for r in record["runs"]}
    ddp, one, two = runs["ddp", 0], runs["sync_k1", 0], runs["sync_k2", 0]
    assert [e[0] for e in ddp["evals"]][:2] == [48, 96] and "updates" not in ddp  # DDP's own events are read
    assert two["evals"] == [] and [v for v, _ in two["updates"]] == list(range(1, 5))  # 96 / (3 x 8): 4 versions
    curve = sharded_curve(two, one)
    assert [e[0] for e in curve] == [e[0] for e in one["evals"]] and [e[2] for e in curve] == [
        e[2] for e in one["evals"]
    ]
    assert [e[1] for e in curve] == [dict(two["updates"])[e[4]] for e in one["evals"]]
    other = {**one, "summary": {**one["summary"], "final_loss": one["summary"]["final_loss"] * (1 + 1e-5)}}
    assert sharded_curve(two, other) == []  # not the same model at the end: no curve
    other["summary"]["final_loss"] = one["summary"]["final_loss"] * (1 + 1e-8)  # the order of float sums: the same
    assert sharded_curve(two, other) == curve
    f = findings.compute({"f13_shards": record})["F13"]
    assert f["same_update"] == {"sync_k2": "2/2"} and f["aa"]["throughput_ratio"]["values"] == [1.0, 1.0]
    assert f["arms"]["sync_k2"]["reached"] == f["arms"]["sync_k1"]["reached"]
    assert f["vs_ddp"]["sync_k1"]["final_accuracy_difference"]["values"] == [0.0, 0.0]  # the same update as DDP's
    assert set(f["vs_ddp"]) == {"sync_k1", "sync_k2", "async_k1"} and f["arms"]["async_k1"]["samples_per_step"] == 8
    assert "| sync PS, k = 2 | none | 24 |" in render(findings.compute({"f13_shards": record}))["F13"]


def test_the_uplink_schedule_changes_the_link_mid_run_in_virtual_time_only(tmp_path):
    config = ps_config(
        tmp_path,
        "schedule",
        system__clock="virtual",
        system__num_workers=2,
        emulation__uplink_mbps=250,
        emulation__uplink_schedule=[[0.05, 25], [2.0, 100]],
        **{f"emulation__{k}": v for k, v in COSTS.items()},
    )
    cost = CostModel(config)
    assert [cost.uplink_bps(0, t) for t in (0.0, 0.049, 0.05, 1.9, 2.0, 9.0)] == [
        250e6,
        250e6,
        25e6,
        25e6,
        100e6,
        100e6,
    ]
    summary = run_virtual(config, tensorboard=False)
    assert summary["cost_model"]["uplink_schedule"] == [[0.05, 25.0], [2.0, 100.0]]
    steady = run_virtual(
        ps_config(
            tmp_path,
            "steady",
            system__clock="virtual",
            system__num_workers=2,
            emulation__uplink_mbps=250,
            **{f"emulation__{k}": v for k, v in COSTS.items()},
        ),
        tensorboard=False,
    )
    assert summary["train_time_s"] > steady["train_time_s"] and summary["bytes_sent"] == steady["bytes_sent"]
    with pytest.raises(ConfigError, match=r"^emulation.uplink_schedule: a mid-run link change is modelled in virtual"):
        validate_config({"emulation": {"uplink_schedule": [[1.0, 25]]}})
    with pytest.raises(ConfigError, match="strictly increasing"):
        validate_config({"system": {"clock": "virtual"}, "emulation": {"uplink_schedule": [[1.0, 25], [1.0, 5]]}})


def _fashion_files(root: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix in ("train", "t10k"):
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=count, dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels.tobytes())


def _cifar_files(root: Path, count: int) -> None:
    rng = np.random.default_rng(1)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
            "labels": [int(x) for x in rng.integers(0, 10, size=count)],
        }
        (folder / name).write_bytes(pickle.dumps(batch))


@pytest.mark.parametrize(
    "config_name, write_files", [("f1_fashion_mnist", _fashion_files), ("f2_cifar10", _cifar_files)]
)
def test_the_spec_datasets_configs_train_on_files_in_torchvision_layouts(tmp_path, config_name, write_files):
    write_files(tmp_path / "data", 48)
    data = yaml.safe_load((ROOT / "configs" / "experiments" / f"{config_name}.yaml").read_text())
    _, runs = run_matrix.expand(data, config_name)
    experiment, run_data = runs[0]
    run_data["training"].update(
        data_dir=str(tmp_path / "data"), max_train_samples=48, num_epochs=1, eval_every_samples=48
    )
    run_data["metrics"] = {"trackers": []}
    summary = run_virtual(rx.build_config(experiment, run_data, tmp_path / "run"), tensorboard=False)
    assert summary["dataset"] == data["training"]["dataset"] and summary["samples_processed"] == 48
    assert 0.0 <= summary["final_accuracy"] <= 1.0


def test_a_runs_kernels_name_the_cpus_vector_and_matrix_extensions(tmp_path):
    """``cpu_isa`` keeps the flags kernels are picked by (what the records are compared exactly on) and nothing
    else; the provenance table names AMX where a record's extensions hold it."""
    from src.findings.figures import _kernels
    from src.launch.provenance import cpu_isa

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni amx_tile ht\n")
    assert cpu_isa(cpuinfo) == "amx_tile avx2 avx512_vnni avx512f fma"
    assert cpu_isa(tmp_path / "none") == "unknown"
    run = {"cpu_capability": "AVX512", "torch_version": "2.14.1"}
    assert _kernels(run) == "AVX512, torch 2.14.1"
    assert _kernels({**run, "cpu_isa": cpu_isa(cpuinfo)}) == "AVX512 with AMX, torch 2.14.1"
