"""Run ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) as its own process, forked with torch already imported.

A test that runs one of the repository's commands pays, in a fresh interpreter, about 2.3 CPU-seconds
and 3 s of wall to import torch before the command does anything; the suite runs a few hundred of
them on 2 cores. Here the command's process is forked from the framework's forkserver
(:mod:`src.common.child_processes`: a fresh interpreter that imported only torch, never gRPC) and then
behaves as ``python`` would with that command line: its own session (so a test kills its whole
group), the given working folder and environment, ``sys.argv`` and ``sys.path[0]`` as the interpreter
sets them, the script run as ``__main__`` (which then imports everything else itself, gRPC included),
``SystemExit`` codes and uncaught exceptions turned into the exit status and traceback ``python`` gives,
non-daemon threads joined and ``atexit`` handlers run at the end, stdout and stderr captured.

What a fork cannot give is a *fresh interpreter*: a command whose environment changes how Python
starts (``PYTHON*`` variables) runs with ``subprocess`` instead, and so does any command line that is
not this interpreter running a script or a module. ``tests/test_readme.py`` runs every README command
(as ``--help``) through a fresh interpreter, so each entry point is also proven to start from nothing.
"""

from __future__ import annotations

import itertools
import multiprocessing.process
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from src.common.child_processes import process_context


def forkable(argv: list[str], env: dict[str, str]) -> bool:
    """Whether ``argv`` (run with environment ``env``) can be forked instead of executed."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1].startswith("-") and not (argv[1] == "-m" and len(argv) > 2):
        return False
    starting = {k: v for k, v in env.items() if k.startswith("PYTHON")}
    return starting == {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}


def _exit_code(code) -> int:
    """The status ``python`` exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class _MainProcess(multiprocessing.process.BaseProcess):
    """What ``multiprocessing.current_process()`` is in a program's main process (the standard library's own
    class for it is not importable)."""

    def __init__(self):
        self._identity = ()
        self._name = "MainProcess"
        self._parent_pid = None
        self._popen = None
        self._closed = False
        self._config = {"authkey": multiprocessing.process.AuthenticationString(os.urandom(32)), "semprefix": "/mp"}


def _as_python(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked child: become ``python argv[1:]`` in ``cwd`` with ``env``; never returns."""
    import atexit
    import io
    import runpy
    import threading
    import traceback

    os.setsid()
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # The command is the main process of its own program, not a multiprocessing child of ours.
    multiprocessing.process._current_process = _MainProcess()
    multiprocessing.process._parent_process = None
    multiprocessing.process._children = set()
    multiprocessing.process._process_counter = itertools.count(1)
    code = 0
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[1])
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - python prints it and exits 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as at interpreter exit: wait for the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # python re-raises an uncaught Ctrl-C as death by SIGINT
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def run_command(
    argv: list[str], *, cwd: str | Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``argv`` run to completion in its own session, forked when :func:`forkable`, else executed; whatever is left
    of its process group is killed when it ends. Raises :class:`TimedOut` past ``timeout`` seconds."""
    run = run_forked if forkable(argv, env) else run_executed
    return subprocess.CompletedProcess(argv, *run(argv, cwd=cwd, env=env, timeout=timeout))


def run_executed(argv: list[str], *, cwd: str | Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """As :func:`run_forked`, for any command: executed in its own session (a fresh interpreter for Python)."""
    process = subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(process.pid)
        raise TimedOut(*process.communicate()) from None
    finally:
        kill_process_group(process.pid)
    return process.returncode, stdout, stderr


def kill_process_group(pid: int) -> None:
    """SIGKILL every process left in process group ``pid`` (nothing if the group is gone already)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class TimedOut(Exception):
    """The command was still running at its deadline (its group has been killed); carries what it printed."""

    def __init__(self, stdout: str, stderr: str):
        super().__init__("timed out")
        self.stdout, self.stderr = stdout, stderr


class ForkedPopen:
    """A Python command started forked (see :func:`forkable`), with what a test uses of :class:`subprocess.Popen`:
    ``pid`` (the leader of its own session), ``args``, ``returncode``, :meth:`poll`, :meth:`wait` and
    :meth:`communicate` (text; stderr ``None`` with ``merge_stderr``, whose output goes to stdout as
    ``stderr=subprocess.STDOUT`` does). ``stdout``/``stderr``: files to write them to (a test that reads
    them while the command runs), else files of its own."""

    def __init__(
        self,
        argv: list[str],
        *,
        cwd: str | Path,
        env: dict[str, str],
        merge_stderr: bool = False,
        stdout: str | Path | None = None,
        stderr: str | Path | None = None,
    ):
        self.args = list(argv)
        self.returncode: int | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix="python_command_")
        self._out = str(stdout or os.path.join(self._scratch.name, "stdout"))
        self._err = self._out if merge_stderr else str(stderr or os.path.join(self._scratch.name, "stderr"))
        self._merged = merge_stderr
        self._process = process_context().Process(
            target=_as_python, args=(self.args, str(cwd), dict(env), self._out, self._err), name="python-command"
        )
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        return self._read(self._out), None if self._merged else self._read(self._err)

    @staticmethod
    def _read(path: str) -> str:
        return Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def run_forked(argv: list[str], *, cwd: str | Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``argv`` run to completion (see :func:`forkable`); whatever is left
    of its process group is killed when it ends. Raises :class:`TimedOut` past ``timeout`` seconds."""
    process = ForkedPopen(argv, cwd=cwd, env=env)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(process.pid)
        process.wait()
        raise TimedOut(*process.communicate()) from None
    finally:
        kill_process_group(process.pid)
    return process.returncode, *process.communicate()
