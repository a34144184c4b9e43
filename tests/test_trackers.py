"""Experiment trackers for real, offline: a run's parameters, metrics and artifacts read back by each library's
own reader.

MLflow logs into a local SQLite store, read back with ``MlflowClient``; W&B runs in offline mode,
and its run file (``run-<id>.wandb``: LevelDB-style log blocks of wandb's protobuf ``Record``
messages) is read back with wandb's own protobuf classes. One baseline run feeds both trackers;
a 2-rank DDP run checks that a distributed run is one tracker run, not one per rank.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from src.config import load_config
from src.metrics import MetricsLogger, read_events
from src.telemetry.trackers import TRACKER_RUNS_FILE, Tracker, TrackerSink, open_trackers, summary_metrics
from tests.ps_fixtures import ROOT
from tests.python_command import run_command
from tests.test_config_cli import _runner

pytestmark = pytest.mark.timeout(180)
PROJECT = "dts-tracker-test"


@pytest.fixture(scope="module", autouse=True)
def stop_wandb_service():
    """wandb runs a service process for its runs in this process; stop it when the module is done."""
    yield
    if "wandb" in sys.modules and sys.modules["wandb"] is not None:
        sys.modules["wandb"].teardown()


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A baseline run logged to MLflow (SQLite store) and W&B (offline) at once."""
    root = tmp_path_factory.mktemp("tracked")
    isolated = {
        "WANDB_DIR": str(root / "wandb_home"),
        "WANDB_CACHE_DIR": str(root / "wandb_cache"),
        "WANDB_CONFIG_DIR": str(root / "wandb_config"),
        "WANDB_DATA_DIR": str(root / "wandb_data"),
    }
    saved_env, saved_cwd = {k: os.environ.get(k) for k in isolated}, os.getcwd()
    os.environ.update(isolated)
    os.chdir(root)  # MLflow puts the artifacts of a SQLite store under ./mlruns
    uri = f"sqlite:///{root / 'mlflow.db'}"
    logs = root / "logs"
    try:
        status = _runner("run_baseline_training.py")(
            [
                *(
                    "--dataset mnist_5k --num-epochs 2 --max-train-samples 256 --max-test-samples 100 "
                    "--eval-interval 2 --checkpoint-dir"
                ).split(),
                str(root / "ckpt"),
                "--log-dir",
                str(logs),
                "--tracker",
                "mlflow",
                "--tracker",
                "wandb",
                "--set",
                f"metrics.mlflow_tracking_uri={uri}",
                "--set",
                "metrics.wandb_mode=offline",
                "--set",
                f"metrics.project={PROJECT}",
                "--set",
                "metrics.run_name=tracked",
            ]
        )
    finally:
        os.chdir(saved_cwd)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert status == 0
    return {
        "root": root,
        "uri": uri,
        "logs": logs,
        "summary": json.loads((logs / "summary.json").read_text()),
        "evals": [(e["step"], e["test_accuracy"]) for e in read_events(logs / "events.jsonl", kind="eval")],
    }


def assert_same_points(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same (step, value) points, in step order: steps exactly, values to float precision. Compared as two
    flat lists: pytest.approx refuses nested data (a list of tuples) from pytest 9.2 on."""
    got, expected = sorted(got), sorted(expected)
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert [value for _, value in got] == pytest.approx([value for _, value in expected])


@pytest.mark.slow  # one training run with both trackers (a few seconds), shared by these three
def test_mlflow_holds_one_run_with_the_config_metrics_summary_and_artifacts(tracked_run):
    client = MlflowClient(tracked_run["uri"])
    experiment = client.get_experiment_by_name(PROJECT)
    (run,) = client.search_runs([experiment.experiment_id])  # exactly one tracker run for the training run
    summary = tracked_run["summary"]
    assert (run.info.run_name, run.info.status) == ("tracked", "FINISHED")
    assert json.loads((tracked_run["logs"] / TRACKER_RUNS_FILE).read_text())["mlflow"] == run.info.run_id
    params = run.data.params
    assert (params["training.batch_size"], params["training.max_train_samples"], params["system.architecture"]) == (
        "64",
        "256",
        "baseline",
    )
    assert json.loads(params["metrics.trackers"]) == ["tensorboard", "mlflow", "wandb"]
    assert not any("auth_token" in key for key in params)
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/test_accuracy")]
    assert_same_points(history, tracked_run["evals"])
    assert [step for step, _ in history] == [2, 4, 6, 8]  # 4 steps per epoch, every 2 steps and at epoch ends
    assert run.data.metrics["final_accuracy"] == pytest.approx(summary["final_accuracy"])
    assert run.data.metrics["steps"] == summary["steps"] and run.data.tags["architecture"] == "baseline"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.json", "baseline_final.pt"}
    copy = client.download_artifacts(run.info.run_id, "summary.json", str(tracked_run["root"] / "downloaded"))
    assert json.loads(Path(copy).read_text()) == summary


def read_wandb_records(path: Path) -> list:
    """wandb's protobuf ``Record`` messages of an offline run file.

    The file: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of chunks, each with
    a 7-byte header (CRC32C, little-endian length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", path
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@pytest.mark.slow  # one training run with both trackers (a few seconds), shared by these three
def test_wandb_offline_run_holds_the_config_metrics_summary_and_artifacts(tracked_run):
    runs = list((tracked_run["logs"] / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # one tracker run
    (run_file,) = runs[0].glob("run-*.wandb")
    records = read_wandb_records(run_file)
    by_kind: dict[str, list] = {}
    for record in records:
        by_kind.setdefault(record.WhichOneof("record_type"), []).append(record)
    (run,) = by_kind["run"]
    assert (run.run.display_name, run.run.project) == ("tracked", PROJECT)
    assert json.loads((tracked_run["logs"] / TRACKER_RUNS_FILE).read_text())["wandb"] == run.run.run_id
    config = {item.key: json.loads(item.value_json) for r in by_kind["config"] for item in r.config.update}
    assert config["training"]["batch_size"] == 64 and config["system"]["architecture"] == "baseline"
    assert "auth_token" not in config["system"]
    history = []
    for record in by_kind["history"]:
        values = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        if "eval/test_accuracy" in values:
            history.append((values["step"], values["eval/test_accuracy"]))
    assert_same_points(history, tracked_run["evals"])
    final = {}
    for record in by_kind["summary"]:
        final.update({item.key: json.loads(item.value_json) for item in record.summary.update if item.key})
    assert final["final_accuracy"] == pytest.approx(tracked_run["summary"]["final_accuracy"])
    (artifact,) = by_kind["artifact"]
    assert {entry.path for entry in artifact.artifact.manifest.contents} == {"summary.json", "baseline_final.pt"}
    assert [r.exit.exit_code for r in by_kind["exit"]] == [0]


@pytest.mark.slow  # one training run with both trackers (a few seconds), shared by these three
def test_a_restarted_process_continues_the_tracker_run_instead_of_starting_another(tracked_run, tmp_path):
    uri, project = tracked_run["uri"], "dts-restart-test"  # the same store (made once), an experiment of its own
    config = load_config(
        overrides={
            "metrics.trackers": ["mlflow"],
            "metrics.mlflow_tracking_uri": uri,
            "metrics.project": project,
            "system.log_dir": str(tmp_path / "logs"),
        }
    )
    client = MlflowClient(uri)
    for resume in (
        False,
        True,
    ):  # the first attempt, then its restart (the DDP group's next attempt, a recovered server)
        with MetricsLogger(
            tmp_path / "logs", tensorboard=False, sinks=open_trackers(config, tmp_path / "logs", resume=resume)
        ) as log:
            log.scalars("train", 10 * (1 + resume), {"loss": 1.0 - resume / 2})
            if resume:
                log.finish({"final_accuracy": 0.5}, artifacts=[])
    (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["final_accuracy"] == 0.5
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        (10, 1.0),
        (20, 0.5),
    ]
    open_trackers(config, tmp_path / "logs")[0].close()  # a new training run in the same folder: a new tracker run
    assert len(client.search_runs([client.get_experiment_by_name(project).experiment_id])) == 2


def test_a_missing_extra_is_one_error_line_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError, as without the package
    status = _runner("run_baseline_training.py")(
        ["--tracker", "wandb", "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert err == [
        "error: metrics.trackers: wandb needs the wandb package: pip install -e '.[wandb]' (or pip install wandb)"
    ]
    assert not (tmp_path / "ckpt").exists()  # nothing trained


class _Recording(Tracker):
    """A tracker that keeps what it is given (a unit test of the sink alone), failing on demand."""

    name, package = "recording", "json"

    def __init__(self, fail: bool = False):
        self.run_id, self.fail, self.calls = "r1", fail, []

    @classmethod
    def open(cls, config, *, log_dir, run_name, run_id):
        raise NotImplementedError

    def _record(self, kind, *args):
        if self.fail:
            raise ConnectionError("tracker unreachable")
        self.calls.append((kind, *args))

    def log_params(self, params, nested):
        self._record("params", dict(params))

    def log_metrics(self, metrics):
        self._record("metrics", list(metrics))

    def log_summary(self, numbers, text):
        self._record("summary", dict(numbers), dict(text))

    def log_artifacts(self, paths):
        self._record("artifacts", list(paths))

    def end(self, *, finished):
        self.calls.append(("end", finished))


def test_per_worker_figures_are_prefixed_metrics_and_a_failing_tracker_does_not_stop_the_run(tmp_path, caplog):
    tracker = _Recording()
    with MetricsLogger(
        tmp_path, tensorboard=False, sinks=[TrackerSink(tracker, {"a.b": "1"}, {})], role="server"
    ) as log:
        log.event("push", worker=1, version=7, staleness=2, weight=0.5, loss=0.25, accepted=True, gradient_time_s=0.01)
        log.event("register", worker=1)  # not a metric event
        log.scalars("eval", 7, {"test_accuracy": 0.9, "test_loss": float("nan")})
        log.finish(
            {
                "final_accuracy": 0.9,
                "architecture": "parameter_server",
                "faults": {"worker_failures": 1},
                "workers": [
                    {"worker_id": 0, "incarnation": 1, "bytes_sent": 10},
                    {"worker_id": 1, "incarnation": 2, "bytes_sent": 5},
                    {"worker_id": 1, "incarnation": 3, "bytes_sent": 6},
                ],
            },
            artifacts=[tmp_path / "events.jsonl"],
        )
    metrics = {
        (name, step): value for kind, *args in tracker.calls if kind == "metrics" for name, value, step, _ in args[0]
    }
    assert metrics == {
        ("worker_1/push/staleness", 7): 2.0,
        ("worker_1/push/weight", 7): 0.5,
        ("worker_1/push/loss", 7): 0.25,
        ("worker_1/push/gradient_time_s", 7): 0.01,
        ("eval/test_accuracy", 7): 0.9,
    }  # NaN dropped
    (summary,) = [args for kind, *args in tracker.calls if kind == "summary"]
    assert summary == [
        {
            "final_accuracy": 0.9,
            "faults.worker_failures": 1.0,
            "worker_0/bytes_sent": 10.0,
            "worker_1/incarnation_2/bytes_sent": 5.0,
            "worker_1/incarnation_3/bytes_sent": 6.0,
        },
        {"architecture": "parameter_server"},
    ]
    assert tracker.calls[0] == ("params", {"a.b": "1"}) and tracker.calls[-1] == ("end", True)
    assert ("artifacts", [tmp_path / "events.jsonl"]) in tracker.calls

    failing = _Recording(fail=True)
    with caplog.at_level("WARNING", logger="src.telemetry.trackers"):
        with MetricsLogger(tmp_path / "failing", tensorboard=False, sinks=[TrackerSink(failing, None, {})]) as log:
            for step in range(3):
                log.scalars("train", step, {"loss": 1.0})
    assert failing.calls == [("end", False)]  # closed without finish: the run is marked failed
    warnings = [r.getMessage() for r in caplog.records if r.name == "src.telemetry.trackers"]
    assert len(warnings) == 1 and "recording tracker: ConnectionError: tracker unreachable" in warnings[0]
    assert summary_metrics({"workers": []}) == ({}, {})


@pytest.mark.slow
def test_a_two_rank_ddp_run_is_one_tracker_run_logged_by_rank_0(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = run_command(
        [
            sys.executable,
            str(ROOT / "run_ddp_training.py"),
            *(
                "--world-size 2 --num-epochs 1 --max-train-samples 512 --max-test-samples 100 --tracker mlflow --set"
            ).split(),
            f"metrics.mlflow_tracking_uri={uri}",
            "--set",
            f"metrics.project={PROJECT}",
        ],
        cwd=tmp_path,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "logs" / "ddp_cli" / "summary.json").read_text())
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])  # not one per rank
    assert run.info.status == "FINISHED" and run.data.params["system.num_workers"] == "2"
    assert run.data.metrics["samples_processed"] == summary["samples_processed"] == 512
    assert run.data.metrics["final_accuracy"] == pytest.approx(summary["final_accuracy"])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.json", "ddp_final.pt"}
