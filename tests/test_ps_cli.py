"""run_parameter_server_training.py end to end: the spec's commands, its outputs, bad flags, failures, Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from src.common.checkpoint import load_checkpoint
from src.metrics import SUMMARY_FIELDS, read_events
from tests.ps_fixtures import RUNNER, group_members, kill_group, run_cli
from tests.python_command import run_command

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_spec_smoke_run_writes_the_spec_outputs(tmp_path):
    """The spec's fast smoke command (mnist_5k here), with the default output folders."""
    result = run_cli(
        "--workers 2 --dataset mnist_5k --num-epochs 1 --max-train-samples 512 --max-test-samples 128".split(),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    for line in ("Final Accuracy:", "Final Loss:", "Total Time:", "Throughput:"):
        assert line in result.stdout
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "ps_cli" / "parameter_server_final.pt")
    assert checkpoint["model_architecture"] == "simple_cnn" and checkpoint["step"] == 512 // (2 * 64)
    summary = json.loads((tmp_path / "logs" / "ps_cli" / "summary.json").read_text())
    assert set(SUMMARY_FIELDS) <= set(summary)
    assert summary["architecture"] == "parameter_server" and summary["num_workers"] == 2
    assert summary["samples_processed"] == 512 and summary["compression"] == "none"
    assert summary["bytes_sent"] == sum(w["bytes_sent"] for w in summary["workers"]) > 0
    for k in (0, 1):
        worker_logs = tmp_path / "logs" / "ps_cli" / f"worker_{k}"
        assert any(path.name.startswith("events.out.tfevents") for path in worker_logs.iterdir())
        train = list(read_events(worker_logs / "events.jsonl", kind="train"))
        assert train and {"loss", "accuracy", "gradient_time_s", "communication_time_s", "bytes_sent"} <= set(train[-1])
    assert result.stderr.count("registered with 127.0.0.1:") == 2  # a progress line: logged on stderr


@pytest.mark.slow
def test_four_async_topk_workers_from_a_config_file(tmp_path):
    result = run_cli(
        [
            *(
                "--config configs/ps_async_quantization_4workers.yaml --dataset mnist_5k "
                "--num-epochs 1 --max-train-samples 512 --max-test-samples 128 --compression-type "
                "topk --compression-ratio 0.1 --checkpoint-dir"
            ).split(),
            str(tmp_path / "ckpt"),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=RUNNER.parent,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["num_workers"] == 4 and summary["aggregation_mode"] == "async"
    assert summary["compression"] == "topk(0.1)" and summary["samples_processed"] == 512
    assert summary["versions"] == 512 // 64  # every push applied once: 4 workers x 2 steps
    assert (tmp_path / "ckpt" / "parameter_server_final.pt").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compression-ratio", "1.5"], "config error: system.compression_ratio: must be in (0, 1], got 1.5"),
        (["--workers", "0"], "config error: system.num_workers: must be > 0, got 0"),
        (["--role", "worker"], "--role worker needs --worker-id"),
        (["--role", "server", "--server-address", "0.0.0.0:0"], "--role server needs a fixed port"),
    ],
)
@pytest.mark.slow
def test_bad_flags_exit_nonzero_with_one_line(tmp_path, args, message):
    result = run_cli(args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_worker_role_without_a_token_says_so(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "DTS_AUTH_TOKEN"}
    process = run_command(
        [sys.executable, str(RUNNER), *"--role worker --worker-id 0 --server-address 127.0.0.1:1".split()],
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert process.returncode == 1
    assert process.stderr.strip() == "error: no auth token: set system.auth_token in the config or $DTS_AUTH_TOKEN"


@pytest.mark.slow
def test_the_launcher_itself_never_loads_torch(tmp_path):
    """The local runner only starts and watches its children, which train: importing torch (1-1.5 s before the
    first child starts) is theirs alone. A fresh interpreter runs the runner's ``main`` and says what it loaded."""
    probe = (
        "import sys, run_parameter_server_training as runner; "
        "code = runner.main('--workers 2 --dataset mnist_5k --num-epochs 1 --max-train-samples 128'.split()); "
        "print('torch loaded:', 'torch' in sys.modules); sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(RUNNER.parent)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Final Accuracy:" in result.stdout and "torch loaded: False" in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_a_second_server_started_for_the_same_address_refuses_in_one_line(tmp_path, transport):
    """A server's twin, started by mistake beside it, must not share its port (gRPC binds with SO_REUSEPORT unless
    told not to, and the kernel would split the workers' connections between the two): it exits 1 with one line,
    and the first server goes on serving."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = f"--role server --server-address 127.0.0.1:{port} --workers 1 --max-train-samples 64 --transport {transport}"
    env = {**os.environ, "DTS_AUTH_TOKEN": "twin-test"}
    first = subprocess.Popen(
        [sys.executable, str(RUNNER), *args.split()],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in first.stderr:
            if "parameter server listening on" in line:
                break
        assert first.poll() is None, "the first server did not start"
        (tmp_path / "twin").mkdir()
        twin = run_cli(args.split(), cwd=tmp_path / "twin", timeout=120, env=env)
        assert twin.returncode == 1, twin.stderr[-2000:]
        lines = twin.stderr.strip().splitlines()
        assert lines == [f"error: system.server_address: cannot bind 127.0.0.1:{port} (Address already in use)"], lines
        with socket.create_connection(("127.0.0.1", port), timeout=10):  # the first one still accepts
            pass
        assert first.poll() is None
    finally:
        kill_group(first)
        first.communicate()


@pytest.mark.slow
def test_server_that_cannot_start_fails_the_run(tmp_path):
    result = run_cli(["--server-address", "192.0.2.1:0", "--max-train-samples", "64"], cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert "error: parameter server: system.server_address: cannot bind 192.0.2.1:0" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_ctrl_c_stops_every_child(tmp_path):
    process = subprocess.Popen(
        [sys.executable, str(RUNNER), "--workers", "2", "--num-epochs", "50"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as a terminal starts it: with SIGINT at its default even when this test runs in a background job,
        # whose commands inherit SIGINT ignored (a runner started that way keeps ignoring Ctrl-C, as it should)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        registered = set()
        for line in process.stderr:  # wait until both workers are training (progress is logged on stderr)
            found = re.search(r"worker (\d+): registered with", line)
            if found:
                registered.add(found.group(1))
            if len(registered) == 2:
                break
        assert len(registered) == 2, process.stdout.read()
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        try:  # keep reading both pipes while waiting: a full pipe would block the runner's last writes
            _, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            alive = [
                (pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120])
                for pid in group_members(process.pid)
            ]
            os.kill(process.pid, signal.SIGUSR1)  # the runner prints every thread's stack (src.launch.cli.exit_status)
            try:
                _, stderr = process.communicate(timeout=5)
            except subprocess.TimeoutExpired as exc:
                stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
            pytest.fail(
                f"the runner did not exit within 60 s of Ctrl-C; processes left: {alive}; "
                f"stderr ends:\n{stderr[-6000:]}"
            )
        assert process.returncode == 130, stderr[-3000:]
        assert "interrupted" in stderr and "Traceback" not in stderr
        deadline = time.monotonic() + 30
        while group_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)  # children were joined; only multiprocessing's resource tracker may still be exiting
        assert group_members(process.pid) == []
    finally:
        kill_group(process)
        process.wait()
