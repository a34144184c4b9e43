"""Experiment scripts: one experiment, a resumable matrix, the plots and the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from src.launch import experiment as rx
from src.launch import matrix as run_matrix
from tests.ps_fixtures import ROOT, run_process

TINY = {
    "training": {
        "dataset": "mnist_5k",
        "num_epochs": 1,
        "batch_size": 16,
        "max_train_samples": 64,
        "max_test_samples": 64,
        "eval_interval": 2,
        "target_accuracy": 0.2,
        "momentum": 0.4,
    },
    "system": {"num_workers": 1, "aggregation_mode": "async"},
}


def script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_process([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, timeout=timeout)


# ----------------------------------------------------------------------------- expansion and checks (no runs)


def test_a_matrix_expands_into_every_combination_named_by_its_levels():
    matrix = {
        "matrix": {
            "name": "grid",
            "axes": {
                "mode": ["sync", "async"],
                "compression": ["identity", "topk_ef"],
                "uplink_mbps": [None, 250],
                "heterogeneity": {"even": {}, "one_4x": {"emulation.workers": {1: {"slowdown": 4}}}},
                "seed": [0, 1],
            },
        },
        **TINY,
    }
    name, runs = run_matrix.expand(matrix, "file_stem")
    assert name == "grid" and len(runs) == 2 * 2 * 2 * 2 * 2
    names = [experiment["name"] for experiment, _ in runs]
    assert names[0] == "sync__identity__up-inf__even__seed-0" and names[-1] == "async__topk_ef__up-250__one_4x__seed-1"
    by_name = dict((e["name"], data) for e, data in runs)
    last = by_name["async__topk_ef__up-250__one_4x__seed-1"]
    assert last["system"]["aggregation_mode"] == "async" and last["system"]["error_feedback"] is True
    assert last["emulation"] == {"uplink_mbps": 250, "workers": {1: {"slowdown": 4}}} and last["training"]["seed"] == 1
    assert by_name["sync__identity__up-inf__even__seed-0"]["system"]["compression_enabled"] is False
    assert TINY["system"] == {"num_workers": 1, "aggregation_mode": "async"}  # the base is not modified
    config = rx.build_config(*runs[-1], Path("/tmp/x") / names[-1])
    assert config.system.log_dir == f"/tmp/x/{names[-1]}/logs" and config.emulation.workers[1].slowdown == 4


def test_the_transport_axis_sets_system_transport():
    _, runs = run_matrix.expand({"matrix": {"name": "t", "axes": {"transport": ["grpc", "tcp"]}}, **TINY}, "m")
    assert [(e["name"], data["system"]["transport"]) for e, data in runs] == [("grpc", "grpc"), ("tcp", "tcp")]


@pytest.mark.parametrize(
    "axes, expected",
    [
        ({"compression": ["zip"]}, "matrix.axes.compression: unknown level 'zip'"),
        ({"speed": [1, 2]}, "matrix.axes.speed: unknown axis"),
        ({"seed": ["a"]}, "matrix.axes.seed: seeds must be integers"),
        ({"mode": []}, "matrix.axes.mode: must be a non-empty list"),
        ({"transport": ["udp"]}, "matrix.axes.transport: must be grpc or tcp, got 'udp'"),
    ],
)
def test_bad_axes_are_named(axes, expected):
    with pytest.raises(rx.ExperimentError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        run_matrix.expand({"matrix": {"axes": axes}, **TINY}, "m")


def test_the_controller_needs_evaluations_and_turns_adaptive_compression_on(tmp_path):
    experiment, data = rx.split_experiment(
        {"experiment": {"controller": "on"}, **TINY, "training": {**TINY["training"], "eval_interval": 0}}, "x"
    )
    with pytest.raises(rx.ExperimentError, match="experiment.controller: on decides at evaluations"):
        rx.build_config(experiment, data, tmp_path)
    experiment, data = rx.split_experiment({"experiment": {"controller": "on"}, **TINY}, "x")
    assert rx.build_config(experiment, data, tmp_path).system.adaptive_compression is True
    with pytest.raises(rx.ExperimentError, match="experiment.seeds: unknown key"):
        rx.split_experiment({"experiment": {"seeds": 3}}, "x")


def test_the_shipped_experiment_configs_are_valid(tmp_path):
    configs = ROOT / "configs"
    patterns = ("experiments/*.yaml", "smoke_*.yaml", "matrix_*.yaml", "baselines/*.yaml", "adaptive/*.yaml")
    files = sorted(path for pattern in patterns for path in configs.glob(pattern))
    assert {"smoke.yaml", "smoke_fmnist.yaml", "matrix_cifar_full.yaml"} <= {f.name for f in files}
    for path in files:
        data = yaml.safe_load(path.read_text())
        if "matrix" in data:
            _, runs = run_matrix.expand(data, path.stem)
        else:
            runs = [rx.split_experiment(data, path.stem)]
        for experiment, run_data in runs:
            rx.build_config(experiment, run_data, tmp_path / experiment["name"])


def test_set_changes_the_matrix_file_before_it_is_expanded(tmp_path, capsys):
    matrix_file = tmp_path / "grid.yaml"
    matrix_file.write_text(yaml.safe_dump({"matrix": {"name": "grid", "axes": {"mode": ["sync"], "seed": [0, 1]}}}))
    args = ["--config", str(matrix_file), "--results-dir", str(tmp_path / "r"), "--list"]
    assert run_matrix.main([*args, "--set", "matrix.name=renamed", "--set", "matrix.axes.seed=[3]"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "r" / "renamed" / "sync__seed-3")]
    assert run_matrix.main([*args, "--set", "training.batch_size=0"]) == 2
    assert capsys.readouterr().err.startswith("config error: training.batch_size: ")
    assert run_matrix.main([*args, "--threads", "0"]) == 2
    assert capsys.readouterr().err == "config error: --threads must be at least 1, got 0\n"
    with pytest.raises(SystemExit) as exited:
        run_matrix.main([*args, "--set", "batch_size"])
    assert exited.value.code == 2 and "expected dotted.field=value" in capsys.readouterr().err


def test_plots_names_no_run_and_no_matrix():  # plot_results.py draws a results folder's single runs into plots/
    with pytest.raises(rx.ExperimentError, match="experiment.name: 'plots' is where scripts/plot_results.py draws"):
        rx.split_experiment({"experiment": {"name": "plots"}, **TINY}, "x")
    with pytest.raises(rx.ExperimentError, match="matrix.name: 'plots' is where scripts/plot_results.py draws"):
        run_matrix.expand({"matrix": {"name": "plots", "axes": {"seed": [0]}}, **TINY}, "m")


def test_a_results_folder_is_read_as_its_matrices_and_its_single_runs(tmp_path, capsys):
    from scripts import plot_results  # a script: scripts/ is a namespace package under the root
    from src.reports.results import result_sets

    results = tmp_path / "results"
    one_worker = [(100, 10, 0.1, 0.1)]
    for name in ("identity__seed-0", "topk_ef__seed-0"):
        _fake_run(results / "grid", name, 0, workers=one_worker)
    _fake_run(results / "broken_grid", "identity__seed-0", 0, workers=one_worker)
    (results / "broken_grid" / "identity__seed-0" / "experiment.json").write_text('{"status": "failed"}')
    _fake_run(results, "smoke", 0, workers=one_worker)
    (results / "failed_smoke").mkdir()
    (results / "failed_smoke" / "experiment.json").write_text('{"status": "failed"}')
    _fake_run(results / "plots", "not_a_run", 0, workers=one_worker)  # a folder of plots is never read as runs
    sets = result_sets(results)
    assert [(folder, [run.name for run in runs]) for folder, runs in sets] == [
        (results / "grid", ["identity__seed-0", "topk_ef__seed-0"]),
        (results, ["smoke"]),
    ]
    assert plot_results.main(["--results-dir", str(tmp_path / "nothing")]) == 1
    where = "scripts/run_experiment.py and scripts/run_matrix.py write runs there"
    assert capsys.readouterr().err == f"error: {tmp_path / 'nothing'}: no such folder ({where})\n"
    assert plot_results.main(["--results-dir", str(results / "broken_grid")]) == 1
    assert "no finished run in it" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        plot_results.main(["--out", str(tmp_path / "plots")])
    assert exited.value.code == 2 and "--out goes with --results" in capsys.readouterr().err


@pytest.mark.slow  # starts a process
@pytest.mark.timeout(120)
def test_a_bad_experiment_file_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**TINY, "emulation": {"slowdown": 0.5}}))
    result = script("run_experiment.py", "--config", str(bad), "--results-dir", str(tmp_path / "r"), timeout=60)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "config error: emulation.slowdown: must be >= 1 (1 = the machine's own speed), got 0.5"
    ]
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- a tiny matrix, end to end


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_matrix_runs_resumes_without_redoing_finished_runs_and_plots(tmp_path):
    matrix_file = tmp_path / "tiny.yaml"
    matrix_file.write_text(
        yaml.safe_dump(
            {
                "matrix": {"name": "tiny", "axes": {"compression": ["identity", "topk_ef"], "seed": [0]}},
                **TINY,
                "emulation": {"uplink_mbps": 200},
            }
        )
    )
    results = tmp_path / "results"
    first = script("run_matrix.py", "--config", str(matrix_file), "--results-dir", str(results))
    assert first.returncode == 0, first.stdout + first.stderr
    lines = first.stdout.strip().splitlines()
    assert lines[0] == f"matrix tiny: 2 runs into {results / 'tiny'}"
    assert lines[1].startswith("[1/2] identity__seed-0: done in ") and lines[2].startswith(
        "[2/2] topk_ef__seed-0: done in "
    )
    assert lines[3].startswith("matrix tiny: 2/2 runs finished") and len(lines) == 4  # one line per run, children quiet
    identity, topk = results / "tiny" / "identity__seed-0", results / "tiny" / "topk_ef__seed-0"
    for run in (identity, topk):
        assert {"config.yaml", "experiment.json", "summary.json", "logs", "checkpoints"} <= {
            p.name for p in run.iterdir()
        }
        assert (run / "logs" / "server" / "events.jsonl").is_file() and list(
            (run / "logs" / "server").glob("events.out.tfevents.*")
        )
        summary = json.loads((run / "summary.json").read_text())
        assert summary["samples_processed"] == 64 and summary["emulation"]["workers"]["0"] == {"uplink_mbps": 200.0}
    assert json.loads((topk / "summary.json").read_text())["compression"] == "topk(0.01)"
    assert yaml.safe_load((topk / "config.yaml").read_text())["system"]["error_feedback"] is True

    # interrupt the second run: its folder stays, without a finished summary
    finished_at = (identity / "summary.json").stat().st_mtime_ns
    (topk / "summary.json").unlink()
    status = json.loads((topk / "experiment.json").read_text())
    (topk / "experiment.json").write_text(json.dumps({**status, "status": "running"}))
    (topk / "leftover").write_text("from the interrupted attempt")
    again = script("run_matrix.py", "--config", str(matrix_file), "--results-dir", str(results))
    assert again.returncode == 0, again.stdout + again.stderr
    lines = again.stdout.strip().splitlines()
    assert lines[1] == "[1/2] identity__seed-0: skipped (finished earlier)"
    assert lines[2].startswith("[2/2] topk_ef__seed-0: done in ") and "(redone: interrupted earlier)" in lines[2]
    assert (identity / "summary.json").stat().st_mtime_ns == finished_at
    assert (topk / "summary.json").is_file() and not (topk / "leftover").exists()

    plotted = script("plot_results.py", "--results", str(results / "tiny"))
    assert plotted.returncode == 0, plotted.stderr
    plots = results / "tiny" / "plots"
    for name in ("accuracy_vs_time", "accuracy_vs_bytes", "time_to_target", "bytes_per_run", "staleness", "controller"):
        assert (plots / f"{name}.png").stat().st_size > 5_000, name
    table = (plots / "results.md").read_text()
    assert "| identity__seed-0 | async | none |" in table and "| topk_ef__seed-0 | async | topk(0.01) |" in table
    assert "| identity | 1 |" in table and "| topk_ef | 1 |" in table  # one row per configuration over its seeds


def _workers(workers: list[tuple]) -> list[dict]:
    """A summary's ``workers`` from (samples, steps, gradient time, communication time) per worker."""
    fields = ("samples", "steps", "gradient_time_s", "communication_time_s")
    return [{"worker_id": k, **dict(zip(fields, w)), "compression_time_s": 0.0} for k, w in enumerate(workers)]


def _fake_run(folder: Path, name: str, seed: int, **summary) -> None:
    """A finished run folder holding only what the plots and findings read."""
    run = folder / name
    (run / "logs").mkdir(parents=True)
    workers = summary.pop("workers")
    base = {
        "architecture": "parameter_server",
        "aggregation_mode": "async",
        "compression": "none",
        "final_accuracy": 0.9,
        "total_time_s": 10.0,
        "train_time_s": 8.0,
        "target_accuracy": 0.85,
        "bytes_sent": 100,
        "bytes_received": 100,
        "throughput_samples_per_s": 100.0,
        "emulation": None,
        "staleness_histogram": {"0": 3, "1": 1},
    }
    (run / "summary.json").write_text(json.dumps({**base, **summary, "workers": _workers(workers)}))
    (run / "experiment.json").write_text(json.dumps({"status": "finished"}))
    (run / "config.yaml").write_text(yaml.safe_dump({"training": {"seed": seed}}))


def _record(name: str, runs: list[tuple[str, int, dict]]) -> dict:
    """A matrix record (src/findings/record.py) of runs given as (configuration, seed, summary fields)."""
    out = []
    for configuration, seed, fields in runs:
        fields = dict(fields)
        evals = fields.pop("evals", [])
        workers = _workers(fields.pop("workers"))
        summary = {
            "final_accuracy": 0.9,
            "train_time_s": 8.0,
            "bytes_sent": 100,
            "throughput_samples_per_s": 100.0,
            "pushes_rejected": 0,
            **fields,
            "workers": workers,
        }
        out.append(
            {
                "name": f"seed-{seed}__{configuration}",
                "configuration": configuration,
                "seed": seed,
                "experiment": {"clock": "virtual"},
                "config": {},
                "summary": summary,
                "evals": evals,
                "controller": [],
                "applied_max_staleness": 0,
            }
        )
    return {"matrix": name, "runs": out}


def test_findings_figures_follow_their_definitions():
    from src.findings import figures as findings
    from src.findings.format import verdict

    # worker 1 four times slower: rates 100 and 25 samples/s in async -> ideal 125 / (2 x 25) = 2.5
    slow = [(500, 10, 1.0, 9.0), (500, 10, 10.0, 0.0)]
    f1 = _record(
        "f1_stragglers",
        [
            ("sync", 0, {"throughput_samples_per_s": 50.0, "workers": slow, "evals": [[100, 30.0, 0.9, 0.3, 5]]}),
            (
                "async_plain",
                0,
                {
                    "throughput_samples_per_s": 120.0,
                    "workers": [(1000, 20, 5.0, 5.0), (250, 5, 10.0, 0.0)],
                    "evals": [[100, 10.0, 0.9, 0.3, 5]],
                },
            ),
            ("sync_aa", 0, {"throughput_samples_per_s": 50.0, "workers": slow}),
        ],
    )
    f8 = _record(
        "f8_bandwidth",
        [  # per step: dense 10 ms compute + 90 ms comm, top-k 10 + 10 -> ceiling 5
            (
                "up25_dense",
                0,
                {"bytes_sent": 1000, "workers": [(100, 10, 0.1, 0.9)], "evals": [[50, 40.0, 0.85, 0.3, 3]]},
            ),
            (
                "up25_topk25",
                0,
                {"bytes_sent": 200, "workers": [(100, 10, 0.1, 0.1)], "evals": [[50, 10.0, 0.85, 0.3, 3]]},
            ),
        ],
    )
    f2 = _record(
        "f2_compression",
        [
            (f"sgd__{arm}", 0, {"final_accuracy": accuracy, "bytes_sent": sent, "workers": [(100, 10, 0.1, 0.1)]})
            for arm, accuracy, sent in (
                ("dense", 0.95, 1000),
                ("dense_aa", 0.95, 1000),
                ("topk1", 0.90, 20),
                ("topk1_ef", 0.94, 20),
            )
        ],
    )
    figures = findings.compute({"f1_stragglers": f1, "f8_bandwidth": f8, "f2_compression": f2})
    plain = figures["F1"]["3"]["async_plain"]
    assert plain["ideal_ratio"]["mean"] == pytest.approx(2.5) and plain["throughput_ratio"]["mean"] == pytest.approx(
        2.4
    )
    assert plain["fraction_of_ideal"]["mean"] == pytest.approx(0.96)
    assert plain["time_to_target_speedup"]["0.9"]["mean"] == pytest.approx(3.0)
    link = figures["F8_F9_F10"]["links"]["25"]
    assert link["per_step_ceiling"]["mean"] == pytest.approx(5.0) and link["time_to_target_speedup"]["0.8"][
        "mean"
    ] == pytest.approx(4.0)
    assert link["fraction_of_ceiling"]["0.8"]["mean"] == pytest.approx(0.8) and link["bytes_ratio"][
        "mean"
    ] == pytest.approx(0.2)
    sgd = figures["F2_F4_F5_F6"]["sgd"]
    assert sgd["topk1_ef"]["bytes_ratio"]["mean"] == pytest.approx(0.02)
    assert sgd["topk1_ef"]["accuracy_difference"]["mean"] == pytest.approx(-0.01)
    assert sgd["ef_recovers"]["1"]["mean"] == pytest.approx(0.04)
    assert verdict(plain["fraction_of_ideal"], 0.9) == "yes" and verdict(plain["ideal_ratio"], 10.0) == "no"


def test_the_results_table_has_a_row_per_run_and_per_configuration(tmp_path):
    from src.reports.results import find_runs, markdown_table

    f2 = tmp_path / "f2"
    for name, accuracy, sent in (("identity", 0.95, 1000), ("topk_ef", 0.94, 20)):
        _fake_run(f2, f"{name}__seed-0", 0, final_accuracy=accuracy, bytes_sent=sent, workers=[(100, 10, 0.1, 0.1)])
    table = markdown_table(find_runs([f2]))
    assert "| topk_ef__seed-0 | async | none |" in table and "| topk_ef | 1 | 0.9400 |" in table


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ddp_experiment_runs_through_the_elastic_launcher(tmp_path):
    """``system.architecture: ddp`` runs real ranks (src.launch.ddp) and leaves the experiment's folder."""
    config_file = tmp_path / "ddp.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "training": {**TINY["training"], "momentum": 0.9},
                "system": {
                    "architecture": "ddp",
                    "num_workers": 2,
                    "compression_enabled": True,
                    "compression_type": "topk",
                    "compression_ratio": 0.1,
                },
            }
        )
    )
    result = script("run_experiment.py", "--config", str(config_file), "--results-dir", str(tmp_path / "r"))
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = [p for p in (tmp_path / "r").iterdir() if p.is_dir()]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["architecture"] == "ddp" and summary["world_size"] == 2 and summary["samples_processed"] == 64, (
        summary
    )
    assert json.loads((run / "experiment.json").read_text())["status"] == "finished"


@pytest.mark.slow  # two clocks' runs of a matrix (~9 s): the fast suite keeps under 3 minutes
def test_a_matrix_with_a_virtual_clock_runs_both_clocks_on_the_same_experiment(tmp_path):
    matrix_file = tmp_path / "clocks.yaml"
    matrix_file.write_text(
        yaml.safe_dump(
            {
                "matrix": {"name": "clocks", "axes": {"clock": ["real", "virtual"]}},
                **TINY,
                "emulation": {"uplink_mbps": 200, "compute_s": 0.01, "server_update_s": 0.001, "server_reply_s": 0.001},
            }
        )
    )
    assert [e["name"] for e, _ in run_matrix.expand(yaml.safe_load(matrix_file.read_text()), "x")[1]] == [
        "real",
        "virtual",
    ]
    results = tmp_path / "results"
    ran = script("run_matrix.py", "--config", str(matrix_file), "--results-dir", str(results))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    real, virtual = (
        json.loads((results / "clocks" / name / "summary.json").read_text()) for name in ("real", "virtual")
    )
    assert (
        real["clock"] == "real"
        and virtual["clock"] == "virtual"
        and virtual["wall_time_fields"] == ["wall_time_s", "wall_loop_s", "wall_compute_s"]
    )
    for summary in (real, virtual):  # the same job either way: every sample in an applied update, once
        assert summary["samples_processed"] == 64 and summary["pushes_applied"] == 4
    assert virtual["cost_model"]["compute_s"] == {"0": 0.01}
    assert (results / "clocks" / "virtual" / "logs" / "worker_0" / "events.jsonl").is_file()
