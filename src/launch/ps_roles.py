"""One role of a parameter-server job in this process: the server (shard 0), a follower shard or a worker, for runs
across hosts (``--role server`` / ``--role worker``), containers and the local launcher's children
(:mod:`src.launch.ps`).

* :func:`run_server`: the server (shard 0 of a sharded one), started again from its newest checkpoint with
  ``resume`` (a sharded run's shards go back to the newest version every shard checkpointed);
* :func:`run_follower`: a follower shard, which follows shard 0 back when it starts again;
* :func:`run_worker`: one worker (:class:`src.worker.Worker`);
* :func:`wait_for_run_end`: a shard's watch for the run's end.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from src.config import Config
from src.telemetry import tracing
from src.transport.settings import split_address

STARTUP_TIMEOUT_S = 600.0  # server start: imports, dataset, model (a torchvision download can be slow)
logger = logging.getLogger(__name__)


def run_server(
    config: Config,
    *,
    token: str | None = None,
    summary_json: str | Path | None = None,
    on_listening: Callable[[int], None] | None = None,
    resume: str | Path | None = None,
    faults: bool = True,
    on_event: Callable[[str, dict[str, Any]], None] | None = None,
    watch_shards: bool = True,
) -> dict[str, Any]:
    """Serve one run until it is over; returns the run summary.

    Args:
        token: auth token (default: config / ``$DTS_AUTH_TOKEN``; an error if neither has one).
        summary_json: summary path (default ``<log_dir>/summary.json``).
        on_listening: called with the bound port once the server accepts connections.
        resume: continue from this server checkpoint (file or folder); shard 0 of a sharded run across hosts:
            from the newest version every shard has checkpointed (:mod:`src.ps.shards.recovery`).
        faults: fire the config's server faults (``False`` for a restarted server).
        on_event: told about worker failures (the local launcher kills hung processes).
        watch_shards: shard 0 of a sharded run watches the other shards and ends the run when one goes away
            (across hosts; a local launcher restarts the shards itself and says ``False``).
    """
    from src.common.memory import reuse_freed_memory
    from src.parameter_server import ParameterServer
    from src.telemetry.trackers import require_trackers

    require_trackers(config)
    reuse_freed_memory()
    trace = Path(config.system.log_dir) / "server" / tracing.TRACE_FILE
    watching = watch_shards and config.system.num_servers > 1
    followers = _shard_clients(config, token, config.system.shard_addresses[1:]) if watching else []
    agreed = None
    if watching and resume is not None:
        resume, agreed = _common_resume(config, resume, followers)
    with tracing.trace_to(trace, "parameter server", enabled=config.system.trace, restart=not faults):
        server = ParameterServer(config, token=token, resume=resume, faults=faults, on_event=on_event)
        if agreed is not None:
            server.resume_version, server.agreed_instances = agreed
        watch = None
        try:
            port = server.start()
            host, _ = split_address(config.system.server_address)  # as bound: 0.0.0.0 means every interface
            bound = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            logger.info(
                "parameter server listening on %s (%s, %s, %d workers%s)",
                bound,
                config.system.transport,
                config.system.aggregation_mode,
                config.system.num_workers,
                f", resumed at version {server.state.version}" if resume else "",
            )
            if on_listening is not None:
                on_listening(port)
            if watching:
                from src.ps.shards.recovery import ShardWatch

                watch = ShardWatch(followers, config.system.heartbeat_timeout, server.fail)
                watch.start()
            server.wait_until_done()
            if watch is not None:
                watch.stop()  # shard 0 reads the followers' parts next: their end is not a loss any more
            return server.finalize(summary_json)
        finally:
            if watch is not None:
                watch.stop()
            server.stop()
            for client in followers:
                client.close()


def _shard_clients(config: Config, token: str | None, addresses: list[str]) -> list:
    """A client of each of ``addresses`` (other shards of this run), for Status calls."""
    from src.transport.clients import make_client
    from src.transport.settings import require_auth_token

    system = config.system
    token = token or require_auth_token(system)
    return [
        make_client(address, transport=system.transport, token=token, system=system, retries=0, connect_timeout_s=5)
        for address in addresses
    ]


def _common_resume(config: Config, resume: str | Path, followers: list) -> tuple[Path, tuple[int, list[bytes]]]:
    """Shard 0 of a sharded run starting again: its checkpoint of the newest version every shard has, and the
    version with the followers' instances it was chosen with (:func:`src.ps.shards.recovery.choose_version`)."""
    from src.common.checkpoint import CheckpointError, numbered_path
    from src.ps.shards.recovery import choose_version

    folder = Path(resume) if Path(resume).is_dir() else Path(resume).parent
    logger.info("shard 0: asking the other shards which versions they have checkpointed")
    try:
        version, instances = choose_version(_checkpoint_versions(folder), followers, STARTUP_TIMEOUT_S)
    except (TimeoutError, ValueError) as exc:
        raise CheckpointError(f"--resume {resume}: {exc}") from None
    logger.info("shard 0: every shard goes back to version %d", version)
    return numbered_path(folder, version), (version, instances)


def run_follower(
    config: Config,
    shard: int,
    *,
    address: str,
    token: str | None = None,
    on_listening: Callable[[int], None] | None = None,
    wait: Callable[[threading.Event], object],
    resume: str | Path | None = None,
    model: Any = None,
    recovering: bool = False,
) -> Path:
    """Serve follower shard ``shard`` of a sharded run on ``address`` until ``wait(over)`` returns (``over``: set
    once shard 0 has read this shard's part); then write its
    part of the model and return where (:class:`~src.ps.shards.follower_server.FollowerServer`). ``resume``: continue
    from this shard's checkpoint (a file, or the run's checkpoint folder); ``model``: the served model at its
    initial values (default the config's); ``recovering``: starting again across hosts, go back to the version
    shard 0 chooses (:mod:`src.ps.shards.recovery`)."""
    from src.common.memory import reuse_freed_memory
    from src.ps.shards.follower_server import FollowerServer

    reuse_freed_memory()
    trace = Path(config.system.log_dir) / f"server_{shard}" / tracing.TRACE_FILE
    again = resume is not None or recovering  # started again: its predecessor's trace is kept (trace.1.json, ...)
    with tracing.trace_to(trace, f"server shard {shard}", enabled=config.system.trace, restart=again):
        server = FollowerServer(
            config, shard=shard, address=address, token=token, resume=resume, model=model, recovering=recovering
        )
        stopped = False
        try:
            port = server.start()
            logger.info("parameter-server shard %d of %d listening on port %d", shard, config.system.num_servers, port)
            if on_listening is not None:
                on_listening(port)
            if recovering:
                _go_back_with_shard_0(config, server)
            wait(server.core.run_over)
            stopped = True
            return server.stop()
        finally:
            if not stopped:
                server.stop()


def _go_back_with_shard_0(config: Config, server) -> None:
    """A follower starting again across hosts: wait for shard 0 to choose the version, then take it up."""
    from src.ps.shards.recovery import wait_for_resume_version

    [client] = _shard_clients(config, server.token, config.system.shard_addresses[:1])
    try:
        version = wait_for_resume_version(client, server.core.instance, STARTUP_TIMEOUT_S)
    finally:
        client.close()
    server.core.go_back_to(version)
    logger.info(
        "parameter-server shard %d: %s",
        server.shard,
        "shard 0 started afresh, so does this shard" if version is None else f"back to version {version}",
    )


def wait_for_run_end(config: Config, over: threading.Event | None = None, *, poll_s: float = 0.5) -> None:
    """A follower shard on its own host: return once ``over`` is set (shard 0 has read this shard's part:
    :mod:`src.ps.shards.final`), or once shard 0 (``system.shard_addresses[0]``) has said the run is done and has
    then gone away.

    Raises:
        RunFailed: shard 0 started again (another instance), or went away before the run was done and has not
            answered for ``system.heartbeat_timeout``: every shard goes back to a common checkpoint, so this one
            ends for its supervisor to start it again with ``--resume`` (:mod:`src.ps.shards.recovery`).
    """
    from src.ps.shards.recovery import status_or_none
    from src.ps.state.refusals import RunFailed

    system = config.system
    [client] = _shard_clients(config, None, system.shard_addresses[:1])
    done, instance, answered = False, None, time.monotonic()
    try:
        while over is None or not over.is_set():
            status = status_or_none(client)
            if status is None:
                if done:
                    return
                if instance is not None and time.monotonic() - answered > system.heartbeat_timeout:
                    raise RunFailed(
                        f"shard 0 has not answered for {system.heartbeat_timeout:.1f} s: the shards go back "
                        f"together (start this shard again with --resume)"
                    )
            else:
                answered = time.monotonic()
                instance = instance or status.instance
                if status.instance != instance:
                    raise RunFailed("shard 0 started again: the shards go back together (start this one with --resume)")
                done = done or status.done
            if over is not None:
                over.wait(poll_s)
            else:
                time.sleep(poll_s)
    finally:
        client.close()


def run_worker(
    config: Config, worker_id: int, *, token: str | None = None, address: str | None = None, faults: bool = True
) -> dict[str, Any]:
    """Train as worker ``worker_id`` of the server at ``address`` (default ``system.server_address``)."""
    from src.common.memory import reuse_freed_memory
    from src.worker import Worker

    reuse_freed_memory()
    trace = Path(config.system.log_dir) / f"worker_{worker_id}" / tracing.TRACE_FILE
    with tracing.trace_to(trace, f"worker {worker_id}", enabled=config.system.trace, restart=not faults):
        return Worker(config, worker_id, address=address, token=token, faults=faults).run()


# ----------------------------------------------------------------------------- spawned children


def _checkpoint_versions(directory) -> list[int]:
    from src.common.checkpoint import numbered_checkpoints

    return [int(path.stem.rsplit("_", 1)[1]) for path in numbered_checkpoints(directory)]
