"""The framework's children are forked from a forkserver that imported only torch: never gRPC, and each child
runs with its parent's environment as of its start (src.common.child_processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from src.common.child_processes import PRELOAD, process_context


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_what_the_forkserver_imports_never_imports_grpc():
    """gRPC does not survive fork: the modules imported before any fork must not bring it in."""
    probe = (
        f"import sys; import {', '.join(PRELOAD)}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100, check=True)
    assert found.stdout.strip() == "[]"


def _report_environment(name: str, send) -> None:
    send.send(os.environ.get(name))


def _child_sees(context, name: str):
    """What a child started now finds in ``name`` of its environment."""
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_report_environment, args=(name, send))
    child.start()
    send.close()
    seen = receive.recv()
    child.join(60)
    assert child.exitcode == 0
    return seen


@pytest.mark.timeout(120)
def test_a_child_runs_with_the_environment_its_parent_had_when_it_started(monkeypatch):
    context = process_context()
    values = []
    for value in ("first", "second"):  # the forkserver starts with the first child; its environment then freezes
        monkeypatch.setenv("DTS_CHILD_PROCESS_PROBE", value)
        values.append(_child_sees(context, "DTS_CHILD_PROCESS_PROBE"))
    monkeypatch.delenv("DTS_CHILD_PROCESS_PROBE")
    values.append(_child_sees(context, "DTS_CHILD_PROCESS_PROBE"))
    assert values == ["first", "second", None]


@pytest.mark.timeout(120)
def test_children_start_with_idle_openmp_threads_sleeping_unless_the_user_said_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _child_sees(process_context(), "OMP_WAIT_POLICY") == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _child_sees(process_context(), "OMP_WAIT_POLICY") == "ACTIVE"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("runner", ["run_parameter_server_training", "run_ddp_training", "run_baseline_training"])
def test_a_runner_sets_the_wait_policy_before_torch_loads(runner):
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: importing a runner sets it (src.launch) before
    anything has imported torch. ``-X importtime`` lists each module as its import ends, a package before its
    submodules start."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = f"import os, sys, {runner}; print(os.environ.get('OMP_WAIT_POLICY'))"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", probe],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        check=True,
    )
    assert done.stdout.strip() == "PASSIVE"
    ended = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "src.launch" in ended
    assert "torch" not in ended or ended.index("src.launch") < ended.index("torch")
