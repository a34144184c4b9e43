"""The consolidated performance report: inputs checked, real runs reported, numbers equal to the summaries.

Fast: bad inputs give one line naming the file and a non-zero exit; a run's events are cut out of a
log other runs appended to; faults become detection and recovery times; benchmark figures are read.
Slow: real small runs (baseline, PS with 2 workers, DDP with 2 ranks) written with --artifacts-dir,
reported with the spec's flags and with --runs-dir; scripts/bench_all.py on one real benchmark.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import generate_performance_report
from src.benchmarks import suite
from src.reports.inputs import Run, ddp_summary_from_ranks, read_event_file, select_run_events
from src.reports.names import NOT_RECORDED, PLOTS, SECTIONS
from src.reports.report import build_report, run_labels
from tests.python_command import run_command

ROOT = Path(__file__).resolve().parent.parent

SUMMARY = {
    "architecture": "baseline",
    "dataset": "mnist_5k",
    "num_workers": 1,
    "final_accuracy": 0.9,
    "final_loss": 0.3,
    "total_time_s": 10.0,
    "train_time_s": 8.0,
    "throughput_samples_per_s": 1000.0,
    "samples_processed": 8000,
    "bytes_sent": 0,
    "bytes_received": 0,
    "compression": "none",
    "checkpoint_path": "ckpt/baseline_final.pt",
    "epochs": 2,
    "steps": 126,
}
RANK = {
    **SUMMARY,
    "architecture": "ddp",
    "num_workers": 2,
    "world_size": 2,
    "rank": 0,
    "samples_processed": 4000,
    "throughput_samples_per_s": 500.0,
    "bytes_sent": 100,
    "bytes_received": 100,
    "bytes_accounting": "estimated",
    "steps_this_run": 63,
    "checkpoint_path": "ckpt/ddp_final.pt",
}


def run_cli(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run a repository script in its own process group; on timeout kill the whole group (workers too)."""
    return run_command([sys.executable, *args], cwd=ROOT, env=dict(os.environ), timeout=timeout_s)


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ----------------------------------------------------------------------------- bad inputs (fast)


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    good = _write(tmp / "baseline.json", SUMMARY)
    rank1 = {**RANK, "rank": 1}
    return {
        "missing": (["--baseline-json", str(tmp / "absent.json")], "no such file"),
        "malformed": (
            ["--baseline-json", str(_write(tmp / "bad.json", '{"architecture": "baseline",'))],
            "malformed JSON",
        ),
        "list": (["--baseline-json", str(_write(tmp / "list.json", [1, 2]))], "not a run summary (a JSON list"),
        "foreign": (
            ["--baseline-json", str(_write(tmp / "other.json", {"name": "resnet", "epochs": 3}))],
            "not a run summary of this project",
        ),
        "wrong architecture": (["--ps-json", str(good)], "architecture is 'baseline', expected 'parameter_server'"),
        "lacks fields": (
            ["--baseline-json", str(_write(tmp / "short.json", {"architecture": "baseline", "final_accuracy": 1}))],
            "summary lacks fields",
        ),
        "not a number": (
            ["--baseline-json", str(_write(tmp / "text.json", {**SUMMARY, "total_time_s": "fast"}))],
            "field total_time_s is not a number",
        ),
        "run summary as rank": (
            ["--ddp-rank-json", str(_write(tmp / "ddp.json", {k: v for k, v in RANK.items() if k != "rank"}))],
            "a run summary, not a per-rank summary",
        ),
        "rank not an integer": (
            ["--ddp-rank-json", str(_write(tmp / "ddp_r.json", {**RANK, "rank": "zero"}))],
            "field rank is not an integer",
        ),
        "rank missing": (
            ["--ddp-rank-json", str(_write(tmp / "ddp_rank_0.json", RANK))],
            "ranks 1 of this 2-rank run are missing",
        ),
        "ranks of two runs": (
            [
                "--ddp-rank-json",
                str(_write(tmp / "r0.json", RANK)),
                str(_write(tmp / "r1.json", {**rank1, "steps": 7})),
            ],
            "from another run",
        ),
        "worker metrics": (
            [
                "--ps-json",
                str(_write(tmp / "ps.json", {**SUMMARY, "architecture": "parameter_server"})),
                "--worker-metrics-json",
                str(_write(tmp / "wm.json", {"worker_id": 0})),
            ],
            "not per-worker metrics",
        ),
        "torn event line": (["--baseline-json", str(good)], "baseline_events.jsonl: line 1 is not JSON"),
        "runs dir": (["--runs-dir", str(tmp / "nowhere")], "no such folder"),
    }


BAD_INPUTS = (
    "missing",
    "malformed",
    "list",
    "foreign",
    "wrong architecture",
    "lacks fields",
    "not a number",
    "run summary as rank",
    "rank not an integer",
    "rank missing",
    "ranks of two runs",
    "worker metrics",
    "torn event line",
    "runs dir",
)


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys, case):
    cases = _bad_inputs(tmp_path)
    if case == "torn event line":  # a broken line in the middle of the events beside baseline.json
        _write(tmp_path / "baseline_events.jsonl", '{"time": 1, "kind": "eval"\n{"time": 2, "kind": "run_end"}\n')
    args, problem = cases[case]
    status = generate_performance_report.main([*args, "--output", str(tmp_path / "out" / "r.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert len(err) == 1 and err[0].startswith("error: ") and problem in err[0], err
    assert err[0].startswith(f"error: {tmp_path}/"), err  # names the file
    assert not (tmp_path / "out").exists()


def test_nothing_to_report_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_performance_report.main(["--output", "x.json"])
    assert exit_info.value.code == 2
    assert "nothing to report" in capsys.readouterr().err


# ----------------------------------------------------------------------------- pure pieces (fast)


def test_run_events_are_cut_from_a_log_several_runs_appended_to():
    def event(t, kind, source="", **fields):
        return {"time": t, "kind": kind, "source": source, **fields}

    events = [
        event(1, "run_start", architecture="ddp"),
        event(2, "eval", test_accuracy=0.1),
        event(3, "run_end"),
        event(0.9, "run_start", "rank_1"),
        event(2.9, "run_end", "rank_1"),
        event(9.9, "run_start", "rank_1"),
        event(10.5, "rank_restarted", "rank_1", rank=1),
        event(12.9, "run_end", "rank_1"),
        event(10, "run_start", architecture="ddp"),
        event(11, "eval", test_accuracy=0.5),
        event(13, "run_end"),
        event(14, "run_start", architecture="ddp"),  # a third run that crashed: no run_end, no summary
    ]
    selected = select_run_events(events)
    assert [(e["time"], e["kind"]) for e in selected] == [
        (9.9, "run_start"),
        (10, "run_start"),
        (10.5, "rank_restarted"),
        (11, "eval"),
        (12.9, "run_end"),
        (13, "run_end"),
    ]
    assert select_run_events(selected) == selected  # idempotent: artifacts hold an already-cut log


def test_faults_give_detection_and_recovery_times_and_staleness_comes_from_pushes():
    summary = {
        **SUMMARY,
        "architecture": "parameter_server",
        "num_workers": 2,
        "aggregation_mode": "async",
        "faults": {"worker_failures": 1, "restarts": 1, "server_recoveries": 0, "versions_lost": 0},
    }
    events = [
        {"time": 100.0, "kind": "run_start", "architecture": "parameter_server", "source": "server"},
        *({"time": 101.0 + i, "kind": "push", "staleness": s, "source": "server"} for i, s in enumerate([0, 1, 1, 3])),
        {"time": 106.0, "kind": "worker_failed", "worker": 1, "detection_latency_s": 2.5, "source": "server"},
        {"time": 106.5, "kind": "work_reassigned", "worker": 1, "source": "server"},
        {"time": 107.0, "kind": "worker_restarted", "worker": 1, "source": "server"},
        {"time": 109.0, "kind": "worker_rejoined", "worker": 1, "source": "server"},
        {"time": 110.0, "kind": "run_end", "source": "server"},
    ]
    run = Run(summary, "ps.json", events=events, main_source="server")
    entry = build_report([run])["runs"][0]
    assert entry["staleness"]["histogram"] == {"0": 1, "1": 2, "3": 1}
    assert entry["staleness"]["source"] == "server push events"
    faults = entry["faults"]
    assert faults["happened"] and faults["counts"]["worker_failures"] == 1
    assert faults["detection"] == [{"worker": 1, "seconds": 2.5}]
    assert faults["recovery"] == [{"who": "worker 1", "from": "worker_failed", "to": "worker_rejoined", "seconds": 3.0}]
    assert [e["kind"] for e in faults["timeline"]] == [
        "worker_failed",
        "work_reassigned",
        "worker_restarted",
        "worker_rejoined",
    ]
    assert faults["timeline"][0]["seconds"] == 6.0


@pytest.mark.slow  # matplotlib: a few seconds
@pytest.mark.timeout(120)
def test_fault_section_and_timeline_are_rendered(tmp_path):
    from src.reports.report import write_report

    summary = {**SUMMARY, "architecture": "parameter_server", "num_workers": 2, "aggregation_mode": "async"}
    events = [
        {"time": 50.0, "kind": "run_start", "architecture": "parameter_server", "source": "server"},
        {"time": 55.0, "kind": "worker_failed", "worker": 0, "detection_latency_s": 1.25, "source": "server"},
        {"time": 58.0, "kind": "worker_rejoined", "worker": 0, "source": "server"},
        {"time": 60.0, "kind": "server_recovered", "versions_lost": 4, "source": "server"},
    ]
    paths = write_report(
        build_report([Run(summary, "ps.json", events=events, main_source="server")]), tmp_path / "r.json"
    )
    faults = paths["markdown"].read_text().split("## Faults")[1].split("## Per worker")[0]
    assert "| 0 | 1.25 s |" in faults and "| worker 0 | worker_failed | worker_rejoined | 3.00 s |" in faults
    assert "Server versions lost to recovery: 4." in faults and "| 10.00 s | server_recovered |" in faults
    assert paths["plot:fault_timeline"].stat().st_size > 5000


def test_a_sharded_runs_load_per_shard_is_tabled(tmp_path):
    from src.reports.report import write_report

    shards = [
        {"shard": 0, "bytes_placed": 842136, "bytes_in": 6747990, "bytes_out": 8423650, "update_s": 0.0015},
        {"shard": 1, "bytes_placed": 844432, "bytes_in": 6763852, "bytes_out": 9289414, "update_s": 0.0027},
    ]
    shards[1]["rolled_back"] = 3  # async pushes too stale on shard 1 alone (a summary before them has none)
    summary = {**SUMMARY, "architecture": "parameter_server", "num_workers": 2, "aggregation_mode": "sync"}
    sharded = {**summary, "shards": shards, "shard_imbalance": 1.028}
    paths = write_report(
        build_report([Run(sharded, "a/summary.json"), Run(summary, "b/summary.json")]), tmp_path / "r.json"
    )
    text = paths["markdown"].read_text()
    assert text.count("load per server shard") == 1 and "(imbalance 1.03x)" in text
    assert "| 1 | 844,432 | 6,763,852 | 9,289,414 | 0.0027 s | 3 |" in text
    assert f"| 0 | 842,136 | 6,747,990 | 8,423,650 | 0.0015 s | {NOT_RECORDED} |" in text


def test_runs_of_one_kind_get_distinct_labels():
    ps = {**SUMMARY, "architecture": "parameter_server", "aggregation_mode": "async", "compression": "topk(0.1)"}
    runs = [
        Run(ps, "a/x/summary.json"),
        Run(ps, "a/y/summary.json"),
        Run(ps, "b/y/summary.json"),
        Run(SUMMARY, "s.json"),
    ]
    assert run_labels(runs) == [
        "ps async topk(0.1) [x]",
        "ps async topk(0.1) [y] #1",
        "ps async topk(0.1) [y] #2",
        "baseline",
    ]


def test_ddp_run_rebuilt_from_ranks_like_the_trainer():
    ranks = [{**RANK, "train_time_s": 8.0}, {**RANK, "rank": 1, "train_time_s": 9.0, "samples_processed": 3990}]
    summary = ddp_summary_from_ranks(ranks)
    assert summary["samples_processed"] == 7990 and summary["train_time_s"] == 9.0
    assert summary["throughput_samples_per_s"] == 7990 / 9.0
    assert summary["bytes_sent"] == 200 and summary["bytes_sent_per_rank_per_step"] == 200 / (2 * 63)
    assert "rank" not in summary


def test_event_file_skips_only_a_torn_last_line(tmp_path):
    path = _write(tmp_path / "events.jsonl", '{"time": 1, "kind": "a"}\n{"time": 2, "kind": "b"}\n{"time": 3, "ki')
    assert [e["kind"] for e in read_event_file(path, "x")] == ["a", "b"]
    assert read_event_file(path, "x")[0]["source"] == "x"


BENCH_RESULTS = {
    "bench_baseline": {
        "trainer_samples_per_s": 2500.0,
        "plain_loop_samples_per_s": 2450.0,
        "ratio": 1.0204,
        "target_ratio": 0.98,
    },
    "bench_compression": {
        "sizes": {
            "11000000": {
                "topk_sampled_0.01": {"compress_ms": 13.0},
                "torch_topk_1pct_ms": 80.0,
                "sampled_topk_speedup": {"compress_vs_torch_topk": 6.15},
            }
        }
    },
    "bench_ps": {
        "round_trips": [
            {
                "transport": "tcp",
                "model_mb": 1.0,
                "ps_round_trip_ms": 1.5,
                "raw_tcp_echo_ms": 0.6,
                "optimizer_step_ms": 0.2,
                "limit_ratio": 0.53,
                "target_limit_ratio": 0.6,
            },
            {
                "transport": "grpc",
                "model_mb": 1.0,
                "ps_round_trip_ms": 5.0,
                "raw_tcp_echo_ms": 0.6,
                "grpc_echo_ms": 2.8,
                "optimizer_step_ms": 0.2,
                "limit_ratio": 0.16,
                "grpc_limit_ratio": 0.6,
                "target_grpc_limit_ratio": 0.8,
            },
        ],
        "training": {
            "ddp_2_ranks": {"samples_per_s": 2000.0},
            "ps_sync_2_workers": {"transport": "tcp", "samples_per_s": 1900.0, "target_ratio_to_ddp": 0.9},
        },
    },
    "bench_ddp": {
        "overhead": {
            "trainer_samples_per_s": 2700.0,
            "plain_ddp_samples_per_s": 2750.0,
            "ratio": 0.9818,
            "target_ratio": 0.97,
        },
        "powersgd_vs_topk": {
            "topk_error_feedback_same_bytes": {"final_accuracy": 0.817, "train_time_s": 3.41},
            "powersgd_rank2": {"final_accuracy": 0.819, "train_time_s": 3.64},
        },
    },
    "bench_virtual": {
        "overhead": {
            "workers": 64,
            "compression": "none",
            "loop_wall_s": 4.6,
            "in_run_compute_s": 3.7,
            "in_run_overhead_ratio": 1.243,
        },
        "memory": {"workers": 64, "model_mb": 22.3, "peak_rss_gb": 6.5, "target_gb": 8},
    },
    "bench_rpc_peer": {
        "models": [
            {
                "model": "wide_mlp",
                "arms": {
                    "ours_tcp": {"samples_per_s": 725.4, "ratio_to_peer": 0.882, "target_ratio_to_peer": 1.2},
                    "ours_tcp_streamed": {"samples_per_s": 782.7, "ratio_to_peer": 0.952},
                    "torch_rpc_peer": {"samples_per_s": 822.2, "ratio_to_peer": 1.0},
                },
            }
        ]
    },
}


def test_bench_figures_sit_beside_their_references():
    rows = [row for name, extract in suite.FIGURES.items() for row in extract(BENCH_RESULTS[name])]
    by_reference = {row["reference_name"]: row for row in rows}
    assert set(by_reference) >= {
        "plain PyTorch loop",
        "plain DDP loop",
        "raw TCP echo + optimizer step",
        "raw gRPC echo + optimizer step",
        "DDP, 2 ranks",
        "torch.topk (selection alone)",
        "PowerSGD rank 2",
    }
    assert (
        by_reference["plain PyTorch loop"]["meets_target"] is True
        and by_reference["plain PyTorch loop"]["target"] == 0.98
    )
    assert by_reference["plain DDP loop"]["meets_target"] is True
    assert (
        by_reference["torch.topk (selection alone)"]["ratio"] == 6.15
        and by_reference["torch.topk (selection alone)"]["target"] == 5.0
    )
    assert (
        by_reference["its gradients' forward/backward alone"]["meets_target"] is True
    )  # 1.243 <= 1.3, lower is better
    assert by_reference["the 8 GB target"]["meets_target"] is True
    tcp = by_reference["raw TCP echo + optimizer step"]
    assert (tcp["reference"], tcp["ratio"], tcp["target"], tcp["meets_target"]) == (0.8, 0.53, 0.6, False)
    assert by_reference["raw gRPC echo + optimizer step"]["ratio"] == 0.6
    assert by_reference["DDP, 2 ranks"]["ratio"] == 0.95 and by_reference["DDP, 2 ranks"]["meets_target"] is True
    peer = [row for row in rows if row["benchmark"] == "bench_rpc_peer"]  # the peer itself is no row of its own
    assert [(r["figure"], r["reference"], r["ratio"], r["meets_target"]) for r in peer] == [
        ("wide_mlp sync training samples/s, ours_tcp", 822.2, 0.882, False),
        ("wide_mlp sync training samples/s, ours_tcp_streamed", 822.2, 0.952, None),
    ]
    assert suite.last_json_document('progress {not json}\n{"a": {"b": 1}}\n') == {"a": {"b": 1}}


# ----------------------------------------------------------------------------- real runs (slow)


SMALL = "--dataset mnist_5k --max-train-samples 512 --max-test-samples 128 --num-epochs 2 --device cpu".split()


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Baseline, PS (sync, 2 workers) and DDP (2 ranks) on 512 mnist_5k samples, each writing --artifacts-dir."""
    root = tmp_path_factory.mktemp("report_runs")
    artifacts = root / "artifacts"
    runners = {
        "baseline": ["run_baseline_training.py"],
        "ps": ["run_parameter_server_training.py", "--workers", "2"],
        "ddp": ["run_ddp_training.py", "--world-size", "2"],
    }
    for name, command in runners.items():
        done = run_cli(
            [
                *command,
                *SMALL,
                "--log-dir",
                str(root / "logs" / name),
                "--checkpoint-dir",
                str(root / "checkpoints" / name),
                "--artifacts-dir",
                str(artifacts),
            ],
            timeout_s=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "artifacts:" in done.stdout
    return root


def _spec_command(artifacts: Path, output: Path) -> list[str]:
    return [
        "generate_performance_report.py",
        "--output",
        str(output),
        "--baseline-json",
        str(artifacts / "baseline.json"),
        "--ps-json",
        str(artifacts / "ps.json"),
        "--ddp-rank-json",
        str(artifacts / "ddp_rank_0.json"),
        str(artifacts / "ddp_rank_1.json"),
        "--worker-metrics-json",
        str(artifacts / "worker_metrics.json"),
    ]


NUMBERS = (
    "final_accuracy",
    "final_loss",
    "total_time_s",
    "train_time_s",
    "throughput_samples_per_s",
    "samples_processed",
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_report_from_the_spec_flags_has_every_section_plot_and_the_summaries_numbers(real_runs):
    artifacts, output = real_runs / "artifacts", real_runs / "reports" / "perf_report.json"
    done = run_cli(_spec_command(artifacts, output), timeout_s=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(output.read_text())
    markdown = output.with_suffix(".md").read_text()
    page = output.with_suffix(".html").read_text()
    for section in SECTIONS:
        assert f"\n## {section}\n" in markdown, section
        assert f"<h2>{section}</h2>" in page, section
    for name in PLOTS:
        png = output.parent / "perf_report_plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
        assert f"perf_report_plots/{name}.png" in markdown
    assert page.count('src="data:image/png;base64,') == len(PLOTS)
    assert 'src="http' not in page and 'src="perf_report_plots' not in page  # self-contained

    runs = {run["architecture"]: run for run in report["runs"]}
    summaries = {
        arch: json.loads((real_runs / "logs" / name / "summary.json").read_text())
        for arch, name in (("baseline", "baseline"), ("parameter_server", "ps"), ("ddp", "ddp"))
    }
    for architecture, summary in summaries.items():
        run = runs[architecture]
        for key in NUMBERS:
            assert run[key] == pytest.approx(summary[key], rel=1e-12, abs=0), (architecture, key)
        assert run["bytes"]["sent"] == summary["bytes_sent"] and run["bytes"]["received"] == summary["bytes_received"]
        assert f"| {run['label']} | {architecture} |" in markdown
        assert f"{summary['final_accuracy'] * 100:.2f}%" in markdown
        assert f"{summary['throughput_samples_per_s']:,.1f}" in markdown
        curve = run["accuracy_curve"]
        assert [p["epoch"] for p in curve] == [1, 2], architecture
        assert curve[-1]["accuracy"] == summary["final_accuracy"]
        assert all(b["seconds"] > a["seconds"] > 0 for a, b in zip(curve, curve[1:])), curve
    assert runs["baseline"]["speedup_vs_baseline"] == 1.0
    assert runs["ddp"]["speedup_vs_baseline"] == pytest.approx(
        summaries["ddp"]["throughput_samples_per_s"] / summaries["baseline"]["throughput_samples_per_s"]
    )
    assert runs["ddp"]["bytes"]["estimated"] and "estimate" in runs["ddp"]["bytes"]["note"]
    assert runs["ddp"]["bytes"]["sent_per_step"] == summaries["ddp"]["bytes_sent_per_rank_per_step"]
    ps = runs["parameter_server"]
    assert [w["worker_id"] for w in ps["per_worker"]] == [0, 1] and [r["rank"] for r in runs["ddp"]["per_rank"]] == [
        0,
        1,
    ]
    assert ps["staleness"]["histogram"] == {"0": summaries["parameter_server"]["pushes_applied"]}
    assert ps["time_split"]["total_s"]["gradient_time_s"] == summaries["parameter_server"]["gradient_time_s"]
    assert ps["compression_ratio"]["value"] == 1.0
    assert not any(run["faults"]["happened"] for run in report["runs"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_runs_dir_finds_the_same_runs_in_the_log_folders(real_runs):
    from_flags = real_runs / "reports" / "flags.json"
    from_dir = real_runs / "reports" / "dir.json"
    assert run_cli(_spec_command(real_runs / "artifacts", from_flags), timeout_s=120).returncode == 0
    done = run_cli(
        ["generate_performance_report.py", "--runs-dir", str(real_runs / "logs"), "--output", str(from_dir)],
        timeout_s=120,
    )
    assert done.returncode == 0, done.stderr
    flags = {r["label"]: r for r in json.loads(from_flags.read_text())["runs"]}
    found = {r["label"]: r for r in json.loads(from_dir.read_text())["runs"]}
    assert set(found) == set(flags) == {"baseline", "ps sync", "ddp allreduce"}
    for label, run in flags.items():
        other = copy.deepcopy(found[label])
        for entry in (run, other):
            entry.pop("origin")
        assert other == run, label  # same numbers, same curves, same per-worker / per-rank tables


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_all_runs_a_benchmark_and_the_report_tables_it(tmp_path, real_runs):
    bench = tmp_path / "bench.json"
    done = run_cli(
        ["scripts/bench_all.py", "--only", "bench_compression", "--quick", "--output", str(bench)], timeout_s=300
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(bench.read_text())
    result = document["results"]["bench_compression"]["result"]
    (row,) = document["figures"]
    entry = result["sizes"]["1000000"]
    assert row["ours"] == entry["topk_sampled_0.01"]["compress_ms"] and row["reference"] == entry["torch_topk_1pct_ms"]
    assert row["ratio"] == entry["sampled_topk_speedup"]["compress_vs_torch_topk"]
    output = tmp_path / "report.json"
    done = run_cli(
        [
            "generate_performance_report.py",
            "--baseline-json",
            str(real_runs / "artifacts" / "baseline.json"),
            "--bench-json",
            str(bench),
            "--output",
            str(output),
        ],
        timeout_s=120,
    )
    assert done.returncode == 0, done.stderr
    markdown = output.with_suffix(".md").read_text()
    assert "torch.topk (selection alone)" in markdown and "stated for 11M floats only" in markdown
