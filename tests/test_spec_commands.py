"""Every command of the two specs' command lists runs as written, from a fresh working folder, on dataset files.

The lists (quoted below, word for word): asgc_AGENTS.txt's "Environment & Commands" and the distributed
training README's (Setup, Usage, Final Validation, Metrics and Reporting, Testing). Each command runs in a
temporary folder that holds links to this checkout's scripts and configs and a ``data/`` folder of small
made-up files in torchvision's layouts (MNIST, Fashion-MNIST, CIFAR-10: the real ones cannot be downloaded
here), so the relative paths every command writes (``results/``, ``logs/``, ``checkpoints/``, ``artifacts/``,
``reports/``) land there, as they would in a user's checkout. Where a command cannot run inside a test, the
test checks what it stands for instead:

* ``pytest tests/test_torch_asgc -q``: the folder collects the library's tests, the spec's areas among them
  (running them here would run them twice: they are part of the suite);
* ``python scripts/run_matrix.py --config configs/matrix_cifar_full.yaml``: ``--list`` prints its runs, a run
  of its configurations trains on CIFAR-10 files in torchvision's layout, and without the files it stops
  before its first run with the one-line missing-dataset error (the whole matrix is hours of ResNet-18);
* ``pip install -e .``: ``torch_asgc`` is importable from outside the checkout, from this checkout;
* the runners that feed ``generate_performance_report.py`` are run with ``--artifacts-dir artifacts``, the
  flag that writes the report's inputs (the report command names them).

What is not run (:data:`NOT_RUN`) says why. Every command starts its own processes under a timeout.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from src.common.checkpoint import load_checkpoint
from src.launch import experiment as rx
from src.launch import matrix as run_matrix
from tests.ps_fixtures import ROOT, run_process
from tests.test_data import _write_idx
from tests.test_findings import _cifar_files, _fashion_files

ASGC_COMMANDS = [  # asgc_AGENTS.txt, "Environment & Commands"
    "pip install -r requirements.txt",
    "pip install -e .",
    "pytest tests/test_torch_asgc -q",
    "pytest tests/ -q",
    "python scripts/run_experiment.py --config configs/smoke_fmnist.yaml",
    "python scripts/run_matrix.py --config configs/matrix_cifar_full.yaml",
    "python scripts/plot_results.py",
]
README_COMMANDS = [  # the distributed training README, in its order (continuation lines joined)
    "pip install -r requirements.txt",
    "python -m venv .venv",
    r".\.venv\Scripts\Activate.ps1",
    'pytest -q -m "not slow"',
    "python run_baseline_training.py",
    "python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 2",
    "python run_parameter_server_training.py --workers 4 --dataset mnist --num-epochs 2",
    "python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 2 --aggregation-mode async "
    "--compression-enabled --compression-type topk --compression-ratio 0.1",
    "python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 1 --max-train-samples 512 "
    "--max-test-samples 128",
    "python run_parameter_server_training.py --workers 4 --dataset mnist --num-epochs 1 --max-train-samples 512 "
    "--max-test-samples 128",
    "docker compose up --build",
    "python run_ddp_training.py --world-size 1 --dataset mnist --num-epochs 1",
    "python run_ddp_training.py --world-size 2 --dataset mnist --num-epochs 2",
    "python run_ddp_training.py --dataset synthetic --world-size 2 --num-epochs 1 --num-samples 2048 --optimizer sgd",
    "python run_final_checkpoint_validation.py --workers 4 --epochs 2 --max-train-samples 5000 --max-test-samples 1000",
    "python generate_performance_report.py --output reports/perf_report.json --baseline-json artifacts/baseline.json "
    "--ps-json artifacts/ps.json --ddp-rank-json artifacts/ddp_rank_0.json artifacts/ddp_rank_1.json "
    "--worker-metrics-json artifacts/worker_metrics.json",
    'pytest -q -m "slow"',
]
NOT_RUN = {
    "pip install -r requirements.txt": "installs from the network: CI's set-up runs it (.ci/run)",
    "pytest tests/ -q": "the whole suite, this file included: CI runs it (.ci/run)",
    'pytest -q -m "not slow"': "the fast suite, this file included",
    'pytest -q -m "slow"': "the slow suite, this file included",
    "python -m venv .venv": "the standard library's venv, not this project's (Windows quick start)",
    r".\.venv\Scripts\Activate.ps1": "PowerShell, Windows only",
    "docker compose up --build": "needs Docker Engine: tests/test_ps_compose.py runs it",
}
REPORT_INPUTS = {  # the runs whose --artifacts-dir files generate_performance_report.py reads
    "python run_baseline_training.py",
    "python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 2",
    "python run_ddp_training.py --world-size 2 --dataset mnist --num-epochs 2",
}
SMOKE = ASGC_COMMANDS[4]
MATRIX = ASGC_COMMANDS[5]
PLOT = ASGC_COMMANDS[6]
LINKED = ["scripts", "configs", "run_baseline_training.py", "run_parameter_server_training.py", "run_ddp_training.py"]
LINKED += ["run_final_checkpoint_validation.py", "generate_performance_report.py"]
MNIST_TRAIN, MNIST_TEST = 512, 128  # the README's smoke sizes: every PS and DDP command trains on all of it
FASHION_COUNT = 1536  # per split: smoke_fmnist's 1,024 + 500, two evaluations of the baselines' 768 samples
CIFAR_COUNT = 64  # per batch file: 320 training images, 64 test images
OFFLINE = {key: "http://127.0.0.1:9" for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
"""A closed port as the proxy: a download attempt fails at once, online or not (no dataset is fetched by a test)."""


def make_workspace(folder: Path, *, data: bool) -> Path:
    """A user's working folder: links to the checkout's scripts and configs, and (``data``) small dataset files."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        (folder / name).symlink_to(ROOT / name)
    if data:
        rng = np.random.default_rng(7)
        for prefix, count in (("train", MNIST_TRAIN), ("t10k", MNIST_TEST)):
            images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
            _write_idx(folder / "data" / "MNIST" / "raw", prefix, images, rng.integers(0, 10, count, dtype=np.uint8))
        _fashion_files(folder / "data", FASHION_COUNT)
        _cifar_files(folder / "data", CIFAR_COUNT)
    return folder


def run_command(command: str, cwd: Path, *, timeout: float, env: dict[str, str] | None = None):
    """``command`` (``python ...`` runs this interpreter) in ``cwd``, its process group killed when it ends."""
    words = shlex.split(command)
    if words[0] == "python":
        words[0] = sys.executable
    return run_process(words, cwd=cwd, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("spec") / "checkout", data=True)


_RAN: dict[tuple[Path, str], subprocess.CompletedProcess] = {}


def ran(workspace: Path, command: str, *, timeout: float = 420) -> subprocess.CompletedProcess:
    """``command``'s run in ``workspace`` (once per workspace: the report and the plots read earlier runs)."""
    if (workspace, command) not in _RAN:
        line = command
        if command in REPORT_INPUTS:
            line += " --artifacts-dir artifacts"
        result = run_command(line, workspace, timeout=timeout)
        assert result.returncode == 0, f"{line}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr}"
        _RAN[(workspace, command)] = result
    return _RAN[(workspace, command)]


# ----------------------------------------------------------------------------- what every command names exists


def test_every_command_is_run_or_says_why_not_and_the_paths_it_names_exist():
    run_here = {SMOKE, MATRIX, PLOT, "pip install -e .", "pytest tests/test_torch_asgc -q"}
    run_here |= {c for c in README_COMMANDS if c.startswith("python run_") or c.startswith("python generate_")}
    for command in ASGC_COMMANDS + README_COMMANDS:
        assert (command in run_here) != (command in NOT_RUN), command
    named = [
        word
        for command in ASGC_COMMANDS + README_COMMANDS
        for word in shlex.split(command)[1:]
        if word.startswith(("scripts/", "configs/")) or word in ("requirements.txt", *LINKED)
    ]
    spec_files = {"scripts/run_experiment.py", "scripts/run_matrix.py", "scripts/plot_results.py"}
    spec_files |= {"configs/smoke_fmnist.yaml", "configs/matrix_cifar_full.yaml", "requirements.txt", *LINKED[2:]}
    assert set(named) == spec_files, named  # what the lists name, read right
    assert not [word for word in named if not (ROOT / word).is_file()]
    assert (ROOT / "tests" / "test_torch_asgc" / "__init__.py").is_file()
    assert (ROOT / "docker-compose.yml").is_file()
    # The library's unit tests live in tests/test_torch_asgc/ (about 15 s); its end-to-end runs (equivalence,
    # training, the guide's examples, the plugins' 2-worker runs) stay with the other integration runs in tests/.
    assert sorted(p.name for p in (ROOT / "tests" / "test_torch_asgc").glob("test_*.py")) == [
        "test_library.py",
        "test_library_ddp.py",
    ]


def test_pip_install_e_made_this_checkouts_torch_asgc_importable_from_anywhere(tmp_path):
    code = "import importlib.util; print(importlib.util.find_spec('torch_asgc').origin)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == ROOT / "src" / "torch_asgc" / "__init__.py"
    assert importlib.util.find_spec("torch_asgc").origin == str(ROOT / "src" / "torch_asgc" / "__init__.py")


# ----------------------------------------------------------------------------- configs/ as the spec lays it out


def _experiments(pattern: str) -> list[tuple[Path, dict, dict]]:
    paths = sorted((ROOT / "configs").glob(pattern))
    assert paths, f"configs/{pattern}: none"
    return [(path, *rx.load_experiment_file(path)) for path in paths]


def test_the_configs_folder_holds_the_specs_smoke_baselines_adaptive_and_cifar_matrix(tmp_path):
    for path, experiment, run_data in _experiments("smoke_*.yaml"):
        config = rx.build_config(experiment, run_data, tmp_path / experiment["name"])
        assert config.training.max_train_samples <= 2048, f"{path.name}: a smoke run is small"
    (smoke,) = [e for p, e, _ in _experiments("smoke_*.yaml") if p.name == "smoke_fmnist.yaml"]
    smoke_config = rx.build_config(smoke, rx.load_experiment_file(ROOT / SMOKE.split()[-1])[1], tmp_path / "s")
    assert smoke_config.training.dataset == "fashion_mnist" and smoke_config.system.clock == "real"

    def configs(pattern):
        return [rx.build_config(e, d, tmp_path / e["name"]) for _, e, d in _experiments(pattern)]

    baselines, adaptive = configs("baselines/*.yaml"), configs("adaptive/*.yaml")
    assert len(baselines) >= 3 and not any(c.system.adaptive_compression for c in baselines)
    assert {c.system.compression_enabled for c in baselines} == {False, True}, "dense and fixed compression"
    assert {c.system.aggregation_mode for c in baselines} == {"sync", "async"}
    assert len(adaptive) >= 1 and all(c.system.adaptive_compression for c in adaptive)
    patterns = ("smoke_*.yaml", "baselines/*.yaml", "adaptive/*.yaml")
    names = [experiment["name"] for pattern in patterns for _, experiment, _ in _experiments(pattern)]
    assert len(names) == len(set(names)), "each run has its own folder under results/"
    # the adaptive runs and the baselines share one pipeline, so their runs compare
    pipeline = {(c.training.dataset, c.training.model_architecture, c.system.num_workers) for c in baselines + adaptive}
    assert len(pipeline) == 1, pipeline

    data = yaml.safe_load((ROOT / "configs" / "matrix_cifar_full.yaml").read_text())
    assert {"workers", "staleness", "compression", "seed"} <= set(data["matrix"]["axes"])
    assert list(data["matrix"]["axes"])[0] == "seed", "the seed is the outer axis, as in the findings"
    name, runs = run_matrix.expand(data, "matrix_cifar_full")
    built = [rx.build_config(e, d, tmp_path / name / e["name"]) for e, d in runs]
    assert {(c.training.dataset, c.training.model_architecture) for c in built} == {("cifar10", "resnet18")}
    assert {c.system.num_workers for c in built} == {4, 8}
    assert {(c.system.aggregation_mode, c.system.staleness_policy) for c in built} == {
        ("sync", "none"),
        ("async", "none"),
        ("async", "both"),
    }
    assert {c.system.compression_type if c.system.compression_enabled else "dense" for c in built} == {
        "dense",
        "topk",
        "quantization",
    }
    assert any(c.system.adaptive_compression for c in built) and any(
        c.system.compression_enabled and not c.system.error_feedback for c in built
    )


# ----------------------------------------------------------------------------- the ASGC spec's commands


@pytest.mark.slow  # collecting imports the library's test modules: seconds
@pytest.mark.timeout(180)
def test_pytest_tests_test_torch_asgc_collects_the_librarys_tests_of_the_specs_areas():
    result = run_command("python -m pytest --collect-only -q tests/test_torch_asgc", ROOT, timeout=170)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    assert len(ids) >= 29 and all(i.startswith("tests/test_torch_asgc/") for i in ids), ids
    areas = {
        "TCP transport": "[tcp]",
        "AMP": "amp",
        "bucketing (DDP's gradient buckets through the comm hook)": "test_library_ddp.py::test_one_call_registers",
        "compression": "topk",
        "plugins": "lightning",
        "plugins (Hugging Face)": "huggingface",
    }
    missing = [area for area, needle in areas.items() if not any(needle in i for i in ids)]
    assert not missing, missing


@pytest.mark.slow  # a parameter server and 2 worker processes
@pytest.mark.timeout(480)
def test_the_fashion_mnist_smoke_run_runs_as_written(workspace):
    result = ran(workspace, SMOKE)
    assert result.stdout.strip().splitlines()[-1] == "Results: results/smoke_fmnist"
    summary = json.loads((workspace / "results" / "smoke_fmnist" / "summary.json").read_text())
    assert summary["dataset"] == "fashion_mnist" and summary["samples_processed"] == 1024
    assert summary["compression"] == "topk(0.05)" and 0.0 <= summary["final_accuracy"] <= 1.0


@pytest.mark.slow  # imports and checks 108 runs' configs in a process: seconds
@pytest.mark.timeout(120)
def test_the_cifar_matrix_lists_its_runs(workspace):
    result = run_command(f"{MATRIX} --list", workspace, timeout=110)
    assert result.returncode == 0, result.stderr
    runs = result.stdout.split()
    assert len(runs) == 3 * 2 * 3 * 6 and len(set(runs)) == len(runs)
    assert runs[0] == "results/matrix_cifar_full/seed-0__w4__sync__dense"
    assert runs[-1] == "results/matrix_cifar_full/seed-2__w8__async_bounded__adaptive"
    assert not (workspace / "results" / "matrix_cifar_full").exists()


@pytest.mark.slow  # ResNet-18 gradients on the CPU
@pytest.mark.timeout(300)
def test_the_cifar_matrix_trains_on_files_in_torchvision_layout(tmp_path):
    from src.virtual.run import run_virtual

    _cifar_files(tmp_path / "data", 16)  # 80 training images
    data = yaml.safe_load((ROOT / "configs" / "matrix_cifar_full.yaml").read_text())
    _, runs = run_matrix.expand(data, "matrix_cifar_full")
    chosen = {"seed-0__w4__async_bounded__adaptive", "seed-0__w8__sync__qsgd8"}
    for experiment, run_data in [r for r in runs if r[0]["name"] in chosen]:
        workers = run_data["system"]["num_workers"]
        # two pushes of 2 images per worker (each moves a whole ResNet-18), an evaluation after each round
        run_data["training"].update(data_dir=str(tmp_path / "data"), batch_size=2, max_train_samples=4 * workers)
        run_data["training"].update(num_epochs=1, max_test_samples=8, eval_every_samples=2 * workers)
        run_data["metrics"] = {"trackers": []}
        config = rx.build_config(experiment, run_data, tmp_path / experiment["name"])
        summary = run_virtual(config, tensorboard=False)
        assert summary["dataset"] == "cifar10" and summary["samples_processed"] == 4 * workers, summary
        assert summary["num_workers"] == workers and 0.0 <= summary["final_accuracy"] <= 1.0
        assert (summary["controller"] is not None) == experiment["controller"]
        checkpoint = load_checkpoint(summary["checkpoint_path"])
        assert checkpoint["model_architecture"] == "resnet18"
        state = checkpoint["model_state_dict"]  # ResNet-18 with its CIFAR stem (src/training/models.py), 10 classes
        assert sum(v.numel() for k, v in state.items() if "running_" not in k and "num_batches" not in k) == 11_173_962


@pytest.mark.slow  # virtual-time runs and a parameter server with its workers, then the plots
@pytest.mark.timeout(900)
def test_plot_results_draws_every_run_and_matrix_under_results(workspace):
    ran(workspace, SMOKE)
    ran(workspace, "python scripts/run_experiment.py --config configs/baselines/async_topk25_ef.yaml")
    ran(workspace, "python scripts/run_experiment.py --config configs/adaptive/controller.yaml")
    tiny = workspace / "tiny_matrix.yaml"  # a matrix on the same data, in virtual time: seconds
    base = yaml.safe_load((ROOT / "configs" / "baselines" / "async_topk25_ef.yaml").read_text())
    base.pop("experiment")
    base["training"].update(max_train_samples=768, eval_every_samples=384)
    tiny.write_text(yaml.safe_dump({"matrix": {"name": "tiny", "axes": {"mode": ["sync", "async"]}}, **base}))
    ran(workspace, f"python scripts/run_matrix.py --config {tiny.name} --no-checkpoints")
    tiny_runs = [path for path in (workspace / "results" / "tiny").iterdir() if path.is_dir()]
    assert len(tiny_runs) == 2 and all((run / "summary.json").is_file() for run in tiny_runs), tiny_runs
    assert not any((run / "checkpoints").exists() for run in tiny_runs), "--no-checkpoints left a checkpoint"

    result = ran(workspace, PLOT)
    written = {Path(line) for line in result.stdout.split()}
    results = Path("results")
    for folder in (results / "tiny" / "plots", results / "plots"):
        expected = {"accuracy_vs_time", "accuracy_vs_bytes", "time_to_target", "bytes_per_run", "staleness"}
        assert {folder / f"{name}.png" for name in expected | {"controller"}} | {folder / "results.md"} <= written
        assert all((workspace / path).stat().st_size > 0 for path in written)
    matrix_table = (workspace / "results" / "tiny" / "plots" / "results.md").read_text()
    assert "| sync |" in matrix_table and "| async |" in matrix_table
    single_table = (workspace / "results" / "plots" / "results.md").read_text()
    for name in ("smoke_fmnist", "baseline_async_topk25_ef", "adaptive_controller"):
        assert f"| {name} |" in single_table, name
    assert "| sync |" not in single_table, "a matrix's runs are drawn with their matrix"


@pytest.mark.slow  # each command starts a process that imports torch and tries to download
@pytest.mark.timeout(300)
def test_without_the_files_each_command_is_one_line_and_a_nonzero_exit(tmp_path):
    bare = make_workspace(tmp_path / "checkout", data=False)
    smoke = run_command(SMOKE, bare, timeout=120, env=OFFLINE)
    assert smoke.returncode == 1 and len(smoke.stderr.strip().splitlines()) == 1, smoke.stderr
    assert smoke.stderr.startswith("error: dataset 'fashion_mnist' not found under data/FashionMNIST/raw and it ")
    matrix = run_command(MATRIX, bare, timeout=120, env=OFFLINE)
    assert matrix.returncode == 1 and len(matrix.stderr.strip().splitlines()) == 1, matrix.stderr
    assert matrix.stderr.startswith("error: dataset 'cifar10' not found under data/cifar-10-batches-py and it ")
    assert matrix.stdout == "" and not (bare / "results").exists(), "no run started, no run folder left"
    plot = run_command(PLOT, bare, timeout=60)
    assert plot.returncode == 1 and plot.stderr.strip().splitlines() == [
        "error: results: no such folder (scripts/run_experiment.py and scripts/run_matrix.py write runs there)"
    ]


# ----------------------------------------------------------------------------- the README spec's commands


TRAINED_ELSEWHERE = {  # the README spec's runner commands that the runners' own tests train with (mnist_5k for mnist)
    "python run_parameter_server_training.py --workers 4 --dataset mnist --num-epochs 2": "test_staleness.py",
    "python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 2 --aggregation-mode async "
    "--compression-enabled --compression-type topk --compression-ratio 0.1": "test_staleness.py",
    "python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 1 --max-train-samples 512 "
    "--max-test-samples 128": "test_ps_cli.py",
    "python run_parameter_server_training.py --workers 4 --dataset mnist --num-epochs 1 --max-train-samples 512 "
    "--max-test-samples 128": "test_ps_cli.py",
    "python run_ddp_training.py --world-size 1 --dataset mnist --num-epochs 1": "test_ddp_cli.py",
    "python run_ddp_training.py --dataset synthetic --world-size 2 --num-epochs 1 --num-samples 2048 --optimizer sgd": (
        "test_ddp_cli.py"
    ),
}
"""Run here as written up to ``--print-config`` (the flags, the config they resolve to, the dataset files found):
training with them is what those tests do, and each start of the runner's processes costs the suite seconds."""


@pytest.mark.slow  # each starts the runner's processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "command",
    [c for c in README_COMMANDS if c.startswith("python run_")],
    ids=lambda c: " ".join(c.split()[1:4]),
)
def test_a_readme_runner_command_runs_as_written(workspace, command):
    if command in TRAINED_ELSEWHERE:
        words = shlex.split(command)
        printed = run_command(f"{command} --print-config", workspace, timeout=120)
        assert printed.returncode == 0, printed.stderr
        config = yaml.safe_load(printed.stdout)
        assert config["training"]["dataset"] == words[words.index("--dataset") + 1], config["training"]
        return
    result = ran(workspace, command, timeout=560)
    if "final_checkpoint" in command:
        validation = json.loads((workspace / "reports" / "final_validation" / "validation.json").read_text())
        assert validation["passed"] is True and validation["dataset"] == "mnist", validation
    else:
        assert "Final Accuracy" in result.stdout, result.stdout[-2000:]


@pytest.mark.slow  # the three runs whose artifacts it reads, then the report
@pytest.mark.timeout(900)
def test_the_readme_report_command_reads_the_runners_artifacts(workspace):
    for command in sorted(REPORT_INPUTS):
        ran(workspace, command)
    report_command = next(c for c in README_COMMANDS if c.startswith("python generate_performance_report.py"))
    result = ran(workspace, report_command, timeout=300)
    report = json.loads((workspace / "reports" / "perf_report.json").read_text())
    assert len(report["inputs"]) == 5 and report["baseline"] == "baseline", report["inputs"]
    assert sorted(run["architecture"] for run in report["runs"]) == ["baseline", "ddp", "parameter_server"]
    assert (workspace / "reports" / "perf_report.md").is_file() and (
        workspace / "reports" / "perf_report.html"
    ).is_file()
    assert "reports/perf_report.json" in result.stdout, result.stdout
