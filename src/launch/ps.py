"""Running a parameter-server job: the server and N workers as supervised processes here, or one role.

* :func:`run_local`: spawns the server, waits for it to report its port, spawns the workers, and
  supervises them all until the server reports the run summary. Processes are started with
  ``spawn`` (gRPC does not survive ``fork``).

  - A worker that dies (any non-zero exit, a signal) is started again, up to
    ``system.max_restarts`` times per worker id; the new process registers as a new incarnation and
    gets work. With its budget spent, the run goes on without that worker (the server reassigns its work).
  - A worker the server declares failed while its process still runs was silent for
    ``system.heartbeat_timeout``: hung, or only paused. It gets a heartbeat timeout more to rejoin by
    itself (:class:`~src.common.supervisor.RejoinGrace`; a paused process does, as a new incarnation, under
    ``system.max_rejoins``); one that has not rejoined by then is hung: it is killed, and restarted
    as above. One revocation ends in a rejoin or in one restart, never both. A worker whose rejoin
    budget is spent exits 1, and is restarted as above. With ``system.max_rejoins`` 0 a failed live
    process is killed at once.
  - A server that dies is started again from its newest checkpoint, on the same port, up to
    ``system.max_restarts`` times; the workers register with it again.
  - Faults of ``system.inject_faults`` fire only in first incarnations (a restarted process gets none).
  - An error the user must fix (bad config, missing dataset) ends the run with a :class:`LaunchError`
    naming it; no restart can help.
  - Ctrl-C or SIGTERM stops every child and re-raises :class:`KeyboardInterrupt`. Children ignore
    SIGINT (the launcher decides), so a Ctrl-C in a terminal does not scatter tracebacks.

  Restarts are events in ``<log_dir>/launcher/events.jsonl`` (``worker_restarted``,
  ``server_restarted``, ``worker_killed``, ``worker_rejoined_by_itself``).
* one role in this process (``--role server`` / ``--role worker``, containers) is :mod:`src.launch.ps_roles`'s.

The local launcher makes a random auth token per run unless one is configured; children get it as
a process argument, never on a command line or in a file.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from multiprocessing import connection
from pathlib import Path
from typing import Any

from src.common.child_processes import process_context
from src.common.supervisor import (
    LaunchError,
    RejoinGrace,
    children_ignore_sigint,
    leave_process,
    rejoin_grace_s,
    sigterm_as_keyboard_interrupt,
    stop_processes,
)
from src.config import Config
from src.launch.ps_roles import STARTUP_TIMEOUT_S, _checkpoint_versions, run_follower, run_server, run_worker
from src.metrics import EventLog
from src.telemetry.logs import setup_logging
from src.transport.settings import resolve_auth_token, split_address

STOP_GRACE_S = 5.0
FATAL_EXIT = 3  # a child's exit status for an error no restart can fix (it sent the message first)
logger = logging.getLogger(__name__)


def _with_address(config: Config, address: str) -> Config:
    return config.model_copy(update={"system": config.system.model_copy(update={"server_address": address})})


def _with_shards(config: Config, addresses: list[str]) -> Config:
    return config.model_copy(update={"system": config.system.model_copy(update={"shard_addresses": addresses})})


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


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Errors a user fixes (config, files, datasets): one line, and no restart."""
    from src.common.checkpoint import CheckpointError
    from src.config import ConfigError, SetupError
    from src.training.data import DatasetUnavailableError

    return (ConfigError, SetupError, DatasetUnavailableError, CheckpointError)


def _server_child(
    config: Config,
    token: str,
    summary_json: str | None,
    num_threads: int | None,
    report,
    resume: str | None,
    faults: bool,
) -> None:
    setup_logging(config.system.log_level)  # a spawned process starts with logging unconfigured
    _set_threads(num_threads)
    lock = threading.Lock()  # events come from the server's RPC and monitor threads

    def send(message) -> None:
        with lock:
            report.send(message)

    from src.ps.state.refusals import RunFailed

    try:
        summary = run_server(
            config,
            token=token,
            summary_json=summary_json,
            resume=resume,
            faults=faults,
            on_listening=lambda port: send(("listening", port)),
            on_event=lambda kind, fields: send((kind, fields)),
            watch_shards=False,  # this launcher restarts the shards itself
        )
    except (RunFailed, *_expected_errors()) as exc:  # a restart would fail the same way
        send(("error", f"parameter server: {exc}"))
        raise SystemExit(FATAL_EXIT) from None
    send(("summary", summary))
    leave_process(0)  # done and flushed: native threads must not abort it at shutdown (src.common.supervisor)


def _follower_child(
    config: Config, shard: int, token: str, num_threads: int | None, report, control, resume: str | None
) -> None:
    setup_logging(config.system.log_level)
    _set_threads(num_threads)
    try:
        path = run_follower(
            config,
            shard,
            address=config.system.server_address,
            token=token,
            on_listening=lambda port: report.send(("listening", port)),
            wait=lambda over: control.recv(),  # the launcher says "stop" once shard 0 has the run's summary
            resume=resume,
        )
    except _expected_errors() as exc:
        report.send(("error", f"parameter-server shard {shard}: {exc}"))
        raise SystemExit(FATAL_EXIT) from None
    report.send(("stopped", str(path)))
    leave_process(0)


def _worker_child(config: Config, worker_id: int, token: str, num_threads: int | None, report, faults: bool) -> None:
    setup_logging(config.system.log_level)
    _set_threads(num_threads)
    from src.worker import IncarnationRevoked

    try:
        run_worker(config, worker_id, token=token, faults=faults)
        leave_process(0)  # finished and flushed: native threads must not abort it at shutdown (src.common.supervisor)
    except _expected_errors() as exc:
        report.send(("error", f"worker {worker_id}: {exc}"))
        raise SystemExit(FATAL_EXIT) from None
    except IncarnationRevoked as exc:
        logger.error("worker %d: %s", worker_id, exc)
        raise SystemExit(1) from None


class _LocalRun:
    """The processes of one local run and what the launcher does when one of them ends."""

    def __init__(self, config: Config, summary_json: str | Path | None):
        self.context = process_context()
        self.config = config
        self.summary_json = str(summary_json) if summary_json else None
        self.token = resolve_auth_token(config.system) or secrets.token_urlsafe(32)
        self.num_workers = config.system.num_workers
        self.num_threads = max(1, (os.cpu_count() or 1) // self.num_workers)  # N workers + server share the cores
        self.max_restarts = config.system.max_restarts
        self.restarts: dict[str, int] = {}
        self.server = None
        self.followers: dict[int, Any] = {}  # a sharded server: shard -> its process (shards 1..)
        self.follower_controls: dict[int, Any] = {}  # shard -> the pipe the launcher says "stop" on
        self.shard_addresses: list[str] = []  # every shard's, shard 0 first, once they listen
        self.workers: dict[int, Any] = {}
        self.receivers: list = []
        self.ended: set = set()  # processes whose end the launcher has acted on (restarted, or let go)
        self.pipe_of: dict[Any, Any] = {}  # process -> the receiving end of its report pipe
        self.port: int | None = None
        self.revoked = RejoinGrace(rejoin_grace_s(config.system))  # workers failed while alive: hung, or rejoining
        self.events = EventLog(Path(config.system.log_dir) / "launcher" / "events.jsonl")

    def processes(self) -> list:
        return [p for p in [self.server, *self.followers.values(), *self.workers.values()] if p is not None]

    def start_follower(self, shard: int, *, port: int = 0, resume: str | None = None) -> None:
        """Start follower shard ``shard`` on ``port`` of the server's host (0: a free one; it reports the port)."""
        host, _ = split_address(self.config.system.server_address)
        config = _with_address(self.config, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        send = self._pipe()
        control, self.follower_controls[shard] = self.context.Pipe(duplex=False)
        with children_ignore_sigint():
            process = self.context.Process(
                target=_follower_child,
                name=f"shard-{shard}",
                args=(config, shard, self.token, self.num_threads, send, control, resume),
            )
            process.start()
        send.close()
        control.close()
        self.followers[shard] = process
        self.pipe_of[process] = self.receivers[-1]

    def _pipe(self):
        receive, send = self.context.Pipe(duplex=False)
        self.receivers.append(receive)
        return send

    def start_server(self, *, resume: str | None, faults: bool, config: Config) -> None:
        send = self._pipe()
        with children_ignore_sigint():
            self.server = self.context.Process(
                target=_server_child,
                name="parameter-server",
                args=(config, self.token, self.summary_json, self.num_threads, send, resume, faults),
            )
            self.server.start()
        send.close()
        self.pipe_of[self.server] = self.receivers[-1]

    def start_worker(self, worker_id: int, *, faults: bool) -> None:
        config = _with_address(self.config, connect_address(self.config.system.server_address, self.port))
        if self.shard_addresses:
            config = _with_shards(config, self.shard_addresses)
        send = self._pipe()
        with children_ignore_sigint():
            process = self.context.Process(
                target=_worker_child,
                name=f"worker-{worker_id}",
                args=(config, worker_id, self.token, self.num_threads, send, faults),
            )
            process.start()
        send.close()
        self.workers[worker_id] = process
        self.pipe_of[process] = self.receivers[-1]

    def spend_restart(self, name: str) -> int | None:
        """The restart number for ``name``, or ``None`` when its budget is spent."""
        used = self.restarts.get(name, 0)
        if used >= self.max_restarts:
            return None
        self.restarts[name] = used + 1
        return used + 1

    def newest_checkpoint(self) -> str | None:
        """This run's newest checkpoint (by time: an older run's in the same folder may have higher numbers)."""
        from src.common.checkpoint import unfinished_run_checkpoint

        found = unfinished_run_checkpoint(self.config.system.checkpoint_dir, "parameter_server")
        return str(found) if found else None


def _exit_description(process) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        import signal

        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def run_local(
    config: Config, *, summary_json: str | Path | None = None, resume: str | Path | None = None
) -> dict[str, Any]:
    """The server and ``system.num_workers`` workers as supervised processes of this machine; returns the run summary.

    Args:
        resume: start the server from this checkpoint of an earlier run (file or folder).

    Raises:
        LaunchError: an error no restart can fix, a restart budget spent with nobody left to train,
            or the server failing for good (the message names it).
        KeyboardInterrupt: Ctrl-C or SIGTERM; every child has been stopped.
    """
    from src.telemetry.trackers import require_trackers

    require_trackers(config)  # before any process starts: one line, not one per child
    run = _LocalRun(config, summary_json)
    with sigterm_as_keyboard_interrupt():
        try:
            bind = config.system.server_address
            followers = []
            for shard in range(1, config.system.num_servers):
                run.start_follower(shard)
                followers.append(connect_address(bind, _await_message(run, "listening", STARTUP_TIMEOUT_S)))
            if followers:  # shard 0 reads the followers' parts at the end; its own entry is filled once it listens
                config = run.config = _with_shards(config, [bind, *followers])
            run.start_server(resume=str(resume) if resume else None, faults=True, config=config)
            run.port = _await_message(run, "listening", STARTUP_TIMEOUT_S)
            if followers:
                run.shard_addresses = [connect_address(bind, run.port), *followers]
            for worker_id in range(run.num_workers):
                run.start_worker(worker_id, faults=True)
            summary = _await_message(run, "summary", None)
            if run.followers:
                _stop_followers(run)
            for process in run.processes():
                process.join(STOP_GRACE_S)
            return summary
        finally:
            stop_processes(run.processes(), STOP_GRACE_S)
            for receive in run.receivers:
                receive.close()
            run.events.close()


def _stop_followers(run: _LocalRun) -> None:
    """A sharded run is over (shard 0 has read their parts): each follower writes its part and exits."""
    run.ended.add(run.server)  # shard 0 is done: its exit is not a death to restart from
    for control in run.follower_controls.values():
        control.send("stop")
    for _ in run.followers:
        _await_message(run, "stopped", STARTUP_TIMEOUT_S)


def _await_message(run: _LocalRun, wanted: str, timeout: float | None):
    """Supervise every child until the server sends ``wanted``; restart what dies (see the module docstring)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        _kill_hung(run)
        # A process's end is acted on once, whoever saw it first: its sentinel below, or a poll elsewhere
        # (``is_alive``, ``exitcode``) that already collected its status: such a process is no longer
        # watched, and is acted on here at once.
        unhandled = [p for p in run.processes() if p not in run.ended]
        watched = {p.sentinel: p for p in unhandled if p.exitcode is None}
        ended = [p for p in unhandled if p.sentinel not in watched]
        wake = [t for t in (deadline, run.revoked.next_deadline()) if t is not None]
        limit = 0.0 if ended else max(0.0, min(wake) - time.monotonic()) if wake else None
        ready = connection.wait([*run.receivers, *watched], limit)
        if not ready and not ended:
            if deadline is not None and time.monotonic() >= deadline:
                raise LaunchError(f"timed out after {timeout:.0f}s waiting for the parameter server to be {wanted}")
            continue
        for receive in [r for r in ready if r in run.receivers]:
            found, value = _drain(run, receive, wanted)
            if found:
                return value
        for process in [*ended, *(watched[s] for s in ready if s in watched)]:
            run.ended.add(process)
            process.join()
            found, value = _drain(run, run.pipe_of.get(process), wanted)  # its last words come first
            if found:
                return value
            if process is run.server and run.followers:
                _shards_ended(run, process)
            elif process is run.server:
                _server_ended(run, process)
            elif process in run.followers.values():
                if wanted != "stopped" or process.exitcode != 0:
                    _shards_ended(run, process)
            elif process.exitcode != 0:
                _worker_ended(run, process)


def _drain(run: _LocalRun, receive, wanted: str) -> tuple[bool, Any]:
    """Act on every message waiting in ``receive``; returns ``(True, value)`` once ``wanted`` arrives."""
    while receive is not None and receive in run.receivers and receive.poll():
        try:
            kind, value = receive.recv()
        except (EOFError, OSError):
            run.receivers.remove(receive)  # that child is gone; its sentinel tells the rest
            return False, None
        if kind == "error":
            raise LaunchError(value)
        if kind == wanted:
            return True, value
        if kind == "worker_failed":
            process = run.workers.get(value["worker"])
            if process is not None and process.pid == value["pid"] and process.is_alive():  # hung, or paused
                run.revoked.failed(value["worker"], value["pid"], time.monotonic())
        elif kind == "worker_rejoined" and value["worker"] in run.revoked.waiting:
            run.revoked.rejoined(value["worker"], value["pid"])
            if value["worker"] not in run.revoked.waiting:
                logger.info(
                    "launcher: worker %d (pid %d) rejoined by itself as incarnation %d",
                    value["worker"],
                    value["pid"],
                    value["incarnation"],
                )
                run.events.write(
                    "worker_rejoined_by_itself",
                    worker=value["worker"],
                    pid=value["pid"],
                    incarnation=value["incarnation"],
                )
    return False, None


def _kill_hung(run: _LocalRun) -> None:
    """Kill each process declared failed that has not rejoined within its grace (:class:`RejoinGrace`)."""
    for worker, pid in run.revoked.due(time.monotonic()):
        process = run.workers.get(worker)
        if process is not None and process.pid == pid and process.is_alive():
            process.kill()
            logger.warning(
                "launcher: worker %d (pid %d) was declared failed and has not rejoined within %.1f s: hung; killed it",
                worker,
                pid,
                run.revoked.grace_s,
            )
            run.events.write(
                "worker_killed",
                worker=worker,
                pid=pid,
                reason="declared failed by the server while its process was alive, and it did not rejoin (hung)",
            )


def _server_ended(run: _LocalRun, process) -> None:
    attempt = run.spend_restart("server")
    if attempt is None:
        raise LaunchError(
            f"parameter server {_exit_description(process)}; its restart budget "
            f"(system.max_restarts={run.max_restarts}) is spent"
        )
    resume = run.newest_checkpoint()
    logger.warning(
        "launcher: parameter server %s; restarting it (%s, restart %d/%d)",
        _exit_description(process),
        f"from {resume}" if resume else "from scratch: no checkpoint yet",
        attempt,
        run.max_restarts,
    )
    run.events.write("server_restarted", attempt=attempt, exit=_exit_description(process), resumed_from=resume)
    # Same port: the workers reconnect to the address they know.
    config = _with_address(run.config, connect_address(run.config.system.server_address, run.port))
    run.start_server(resume=resume, faults=False, config=config)


def _shards_ended(run: _LocalRun, process) -> None:
    """A shard of a sharded server died: every shard starts again from the newest version all of them have
    checkpointed (they write at the same versions, and version 0 at the start), on the same ports. A sync
    version is made of the same pushes on every shard, so the versions past it are voided on all of them and
    redone: no shard holds a version the others lack. The workers register again, as after a server restart."""
    from src.common.checkpoint import numbered_path
    from src.ps.shards.follower import shard_checkpoint_dir

    attempt = run.spend_restart("server")
    if attempt is None:
        raise LaunchError(
            f"parameter-server {_shard_name(run, process)} {_exit_description(process)}; the shards' restart "
            f"budget (system.max_restarts={run.max_restarts}) is spent"
        )
    directory = run.config.system.checkpoint_dir
    shards = [run.server, *run.followers.values()]
    for shard in shards:  # the others go back too: stop them
        if shard.exitcode is None:
            shard.kill()
        shard.join()
        run.ended.add(shard)
    versions = set(_checkpoint_versions(directory))
    for shard in run.followers:
        versions &= set(_checkpoint_versions(shard_checkpoint_dir(directory, shard)))
    if not versions:
        raise LaunchError(f"the shards of this run have no checkpointed version in common in {directory}")
    version = max(versions)
    logger.warning(
        "launcher: parameter-server %s %s; every shard starts again from version %d (restart %d/%d)",
        _shard_name(run, process),
        _exit_description(process),
        version,
        attempt,
        run.max_restarts,
    )
    run.events.write(
        "shards_restarted",
        attempt=attempt,
        shard=_shard_name(run, process),
        exit=_exit_description(process),
        version=version,
    )
    bind = run.config.system.server_address
    for shard, address in zip(run.followers, run.shard_addresses[1:]):
        resume = numbered_path(shard_checkpoint_dir(directory, shard), version)
        run.start_follower(shard, port=split_address(address)[1], resume=str(resume))
    config = _with_address(run.config, connect_address(bind, run.port))
    run.start_server(resume=str(numbered_path(directory, version)), faults=False, config=config)


def _shard_name(run: _LocalRun, process) -> str:
    return "shard 0" if process is run.server else process.name.replace("-", " ")


def _worker_ended(run: _LocalRun, process) -> None:
    worker_id = int(process.name.rsplit("-", 1)[1])
    attempt = run.spend_restart(process.name)
    if attempt is None:
        logger.warning(
            "launcher: %s %s; its restart budget is spent, the run goes on without it",
            process.name,
            _exit_description(process),
        )
        run.events.write("worker_abandoned", worker=worker_id, exit=_exit_description(process))
        if not any(p.exitcode is None for p in run.workers.values()):
            raise LaunchError(
                f"every worker has failed and the restart budgets (system.max_restarts={run.max_restarts}) are spent"
            )
        return
    logger.warning(
        "launcher: %s %s; restarting it (restart %d/%d)",
        process.name,
        _exit_description(process),
        attempt,
        run.max_restarts,
    )
    run.events.write("worker_restarted", worker=worker_id, attempt=attempt, exit=_exit_description(process))
    run.start_worker(worker_id, faults=False)
