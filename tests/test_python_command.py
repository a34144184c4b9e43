"""A command forked with torch imported (tests/python_command.py) behaves as the same command executed by python:
the same exit status, output, argv, sys.path[0], working folder, environment, session and ending."""

from __future__ import annotations

import os
import sys

import pytest

from tests.python_command import forkable, run_executed, run_forked

SCRIPT = r"""
import atexit, json, os, sys, threading, time
mode = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
late = threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True)))
late.start()
print(json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "probe": os.environ.get("DTS_PYTHON_COMMAND_PROBE"),
    "own_session": os.getsid(0) == os.getpid(),
    "main": __name__,
    "stdin": sys.stdin.read(),
}))
print("to stderr", file=sys.stderr)
if mode == "message":
    sys.exit("a one-line error")
if mode == "raise":
    raise ValueError("uncaught")
if mode == "interrupt":
    raise KeyboardInterrupt
sys.exit(int(mode))
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("command") / "probe.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["0", "3", "message", "raise", "interrupt"])
def test_a_forked_command_is_the_executed_command(script, tmp_path, mode):
    argv = [sys.executable, str(script), mode]
    env = dict(os.environ, DTS_PYTHON_COMMAND_PROBE="seen")
    assert forkable(argv, env)
    forked = run_forked(argv, cwd=tmp_path, env=env, timeout=60)
    executed = run_executed(argv, cwd=tmp_path, env=env, timeout=60)
    assert forked[0] == executed[0]
    assert forked[1] == executed[1]
    assert "thread finished" in forked[1] and "atexit ran" in forked[1]
    last_line = lambda text: text.strip().splitlines()[-1]  # tracebacks differ in the frames above the script
    assert last_line(forked[2]) == last_line(executed[2])


def test_what_is_not_forked():
    env = dict(os.environ)
    assert not forkable(["python3", "x.py"], env)  # another interpreter
    assert not forkable([sys.executable, "-c", "pass"], env)
    assert not forkable([sys.executable, "x.py"], dict(env, PYTHONHASHSEED="1"))  # changes how python starts
    assert forkable([sys.executable, "-m", "src.transport.healthcheck"], env)
