"""Running a parameter-server job: the server and N workers as processes on this machine, or one role.

* :func:`run_local`: spawns the server, waits for it to report its port, spawns the workers, and
  supervises them. Processes are started with ``spawn`` (gRPC does not survive ``fork``). A child
  that fails ends the run with an error naming it; Ctrl-C or SIGTERM stops every child (terminate,
  then kill what is left) and re-raises :class:`KeyboardInterrupt`. Children ignore SIGINT (the
  launcher decides), so a Ctrl-C in a terminal does not scatter tracebacks.
* :func:`run_server` / :func:`run_worker`: one role in this process, for runs across hosts
  (``--role server`` / ``--role worker``) and containers.

The local launcher makes a random auth token per run unless one is configured; children get it as
a process argument, never on a command line or in a file.
"""

from __future__ import annotations

import os
import secrets
import sys
from multiprocessing import connection
from pathlib import Path
from typing import Any, Callable

from src.config import Config
from src.ps_transport import resolve_auth_token, split_address
from src.supervisor import LaunchError, children_ignore_sigint, sigterm_as_keyboard_interrupt, stop_processes

STARTUP_TIMEOUT_S = 600.0  # server start: imports, dataset, model (a torchvision download can be slow)
STOP_GRACE_S = 5.0


def _with_address(config: Config, address: str) -> Config:
    return config.model_copy(update={"system": config.system.model_copy(update={"server_address": address})})


def connect_address(bind_address: str, port: int) -> str:
    """Where local workers reach a server bound to ``bind_address`` on ``port`` (wildcards -> loopback)."""
    host, _ = split_address(bind_address)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _set_threads(num_threads: int | None) -> None:
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)


# ----------------------------------------------------------------------------- one role in this process


def run_server(
    config: Config,
    *,
    token: str | None = None,
    summary_json: str | Path | None = None,
    on_listening: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Serve one run until every worker has finished; returns the run summary.

    Args:
        token: auth token (default: config / ``$DTS_AUTH_TOKEN``; an error if neither has one).
        summary_json: summary path (default ``<log_dir>/summary.json``).
        on_listening: called with the bound port once the server accepts connections.
    """
    from src.parameter_server import ParameterServer
    from src.ps_transport import reuse_freed_memory

    reuse_freed_memory()
    server = ParameterServer(config, token=token)
    try:
        port = server.start()
        print(f"parameter server listening on {connect_address(config.system.server_address, port)} "
              f"({config.system.aggregation_mode}, {config.system.num_workers} workers)", flush=True)
        if on_listening is not None:
            on_listening(port)
        server.wait_until_done()
        return server.finalize(summary_json)
    finally:
        server.stop()


def run_worker(config: Config, worker_id: int, *, token: str | None = None, address: str | None = None) -> dict[str, Any]:
    """Train as worker ``worker_id`` of the server at ``address`` (default ``system.server_address``)."""
    from src.ps_transport import reuse_freed_memory
    from src.worker import Worker

    reuse_freed_memory()
    return Worker(config, worker_id, address=address, token=token).run()


# ----------------------------------------------------------------------------- spawned children


def _server_child(config: Config, token: str, summary_json: str | None, num_threads: int | None, report) -> None:
    _set_threads(num_threads)
    try:
        summary = run_server(config, token=token, summary_json=summary_json,
                             on_listening=lambda port: report.send(("listening", port)))
    except Exception as exc:
        report.send(("error", f"parameter server: {type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    report.send(("summary", summary))


def _worker_child(config: Config, worker_id: int, token: str, num_threads: int | None) -> None:
    _set_threads(num_threads)
    try:
        run_worker(config, worker_id, token=token)
    except Exception as exc:
        print(f"error: worker {worker_id}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def run_local(config: Config, *, summary_json: str | Path | None = None) -> dict[str, Any]:
    """The server and ``system.num_workers`` workers as processes of this machine; returns the run summary.

    Raises:
        LaunchError: the server or a worker failed (the message names it).
        KeyboardInterrupt: Ctrl-C or SIGTERM; every child has been stopped.
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    token = resolve_auth_token(config.system) or secrets.token_urlsafe(32)
    num_workers = config.system.num_workers
    num_threads = max(1, (os.cpu_count() or 1) // num_workers)  # N workers + server share the cores
    receive, report = context.Pipe(duplex=False)
    processes: list = []
    with sigterm_as_keyboard_interrupt():
        try:
            with children_ignore_sigint():
                server = context.Process(target=_server_child, name="parameter-server",
                                         args=(config, token, str(summary_json) if summary_json else None, num_threads, report))
                server.start()
            processes.append(server)
            report.close()

            port = _expect(receive, processes, "listening", STARTUP_TIMEOUT_S)
            worker_config = _with_address(config, connect_address(config.system.server_address, port))
            with children_ignore_sigint():
                for k in range(num_workers):
                    worker = context.Process(target=_worker_child, name=f"worker-{k}", args=(worker_config, k, token, num_threads))
                    worker.start()
                    processes.append(worker)
            summary = _expect(receive, processes, "summary", None)
            for process in processes:
                process.join(STOP_GRACE_S)
            return summary
        finally:
            stop_processes(processes)
            receive.close()


def _expect(receive, processes, wanted: str, timeout: float | None):
    """Wait for the server's ``wanted`` message while watching every child; raise if one fails first."""
    watched = {process.sentinel: process for process in processes}
    while True:
        ready = connection.wait([receive, *watched], timeout)
        if not ready:
            raise LaunchError(f"timed out after {timeout:.0f}s waiting for the parameter server to be {wanted}")
        if receive in ready:
            try:
                kind, value = receive.recv()
            except EOFError:
                kind, value = "error", "parameter server exited without a result"
            if kind == "error":
                raise LaunchError(value)
            if kind == wanted:
                return value
        for sentinel in [s for s in ready if s in watched]:
            process = watched.pop(sentinel)
            process.join()
            if process.exitcode != 0:
                raise LaunchError(f"{process.name} exited with status {process.exitcode}")
            if process.name == "parameter-server" and not receive.poll():
                raise LaunchError("parameter server exited without a result")
