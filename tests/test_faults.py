"""Fault specs parse exactly, refuse bad input with a line naming the problem, and fire once, in order."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from src.common.faults import FaultInjector, FaultSpec, parse_fault
from src.config import ConfigError, load_config


@pytest.mark.parametrize(
    "text, expected",
    [
        ("kill:worker=1@step=40", FaultSpec("kill", "worker", 1, "step", 40)),
        ("hang:worker=0@step=30", FaultSpec("hang", "worker", 0, "step", 30)),
        ("kill:server@version=150", FaultSpec("kill", "server", None, "version", 150)),
        ("kill:rank=1@step=20", FaultSpec("kill", "rank", 1, "step", 20)),
        ("pause=8:worker=0@step=30", FaultSpec("pause", "worker", 0, "step", 30, 8.0)),
        ("pause=2.5:worker=1@step=3", FaultSpec("pause", "worker", 1, "step", 3, 2.5)),
    ],
)
def test_parse_round_trips(text, expected):
    assert parse_fault(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize(
    "text, problem",
    [
        ("kill:worker=1", "expected ACTION:TARGET@TRIGGER=N"),
        ("explode:worker=1@step=3", "unknown action 'explode'"),
        ("kill:gpu=1@step=3", "unknown target 'gpu'"),
        ("kill:server=0@version=3", "the server takes no number"),
        ("kill:worker@step=3", "say which worker"),
        ("kill:worker=1@version=3", "a worker fault fires at step=N"),
        ("kill:server@step=3", "a server fault fires at version=N"),
        ("kill:worker=1@step=0", "step must be >= 1"),
        ("pause:worker=0@step=3", "pause needs its duration in seconds > 0"),
        ("pause=0:worker=0@step=3", "pause needs its duration in seconds > 0"),
        ("pause=soon:worker=0@step=3", "pause needs its duration in seconds > 0"),
        ("hang=3:worker=0@step=3", "only pause takes a duration"),
        ("pause=3:server@version=3", "pause is for workers"),
    ],
)
def test_bad_specs_name_the_problem(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_fault(text)


def test_config_validates_faults_and_names_the_field():
    assert load_config(overrides={"system.inject_faults": ["kill:worker=1@step=4"]}).system.inject_faults == [
        "kill:worker=1@step=4"
    ]
    with pytest.raises(ConfigError, match=r"system\.inject_faults: fault 'kill:worker=1@step=x'"):
        load_config(overrides={"system.inject_faults": ["kill:worker=1@step=x"]})


def test_injector_keeps_only_its_own_faults_in_order_and_fires_each_once():
    faults = ["kill:worker=1@step=9", "hang:worker=1@step=3", "kill:worker=0@step=2", "kill:server@version=5"]
    injector = FaultInjector(faults, "worker", 1)
    assert [str(f) for f in injector.pending] == ["hang:worker=1@step=3", "kill:worker=1@step=9"]
    assert injector.due(2) is None
    assert str(injector.due(3)) == "hang:worker=1@step=3"
    assert injector.due(3) is None
    assert str(injector.due(12)) == "kill:worker=1@step=9"  # a counter that jumped past it still fires it
    assert not injector
    assert not FaultInjector(faults, "worker", 1, enabled=False)  # a restarted incarnation fires nothing
    assert [str(f) for f in FaultInjector(faults, "server").pending] == ["kill:server@version=5"]


_CHILD = """
import sys, time
from src.common.faults import FaultInjector
injector = FaultInjector([sys.argv[1]], "worker", 0)
for step in range(1, 6):
    print(step, flush=True)
    injector.reached(step)
print("survived", flush=True)
"""


def test_kill_is_a_real_sigkill_at_the_step(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, "kill:worker=0@step=3"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.split() == ["1", "2", "3"]


@pytest.mark.timeout(60)
def test_hang_is_a_real_sigstop_at_the_step():
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "hang:worker=0@step=2"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    try:
        assert child.stdout.readline().strip() == "1"
        assert child.stdout.readline().strip() == "2"
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            state = open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0]
            if state == "T":
                break
            time.sleep(0.05)
        assert state == "T", f"process state {state!r}, expected stopped (T)"
        child.send_signal(signal.SIGCONT)
        assert child.stdout.read().split() == ["3", "4", "5", "survived"]
        assert child.wait(30) == 0
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_pause_is_a_real_sigstop_and_a_real_sigcont_that_many_seconds_later():
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "pause=1.5:worker=0@step=2"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    try:
        assert child.stdout.readline().strip() == "1"
        assert child.stdout.readline().strip() == "2"
        stopped_at, state = None, ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and stopped_at is None:
            state = open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0]
            stopped_at = time.monotonic() if state == "T" else None
            time.sleep(0.02)
        assert stopped_at is not None, f"process state {state!r}, expected stopped (T)"
        assert child.stdout.read().split() == ["3", "4", "5", "survived"]  # nobody here sent SIGCONT
        assert child.wait(30) == 0 and time.monotonic() - stopped_at >= 1.0
    finally:
        child.kill()
        child.wait()
