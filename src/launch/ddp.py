"""Starting a DDP job: N local ranks through torch's elastic agent, or this process as one rank of torchrun.

    python run_ddp_training.py --world-size 2 --num-epochs 2                  # 2 local ranks
    python run_ddp_training.py --world-size 2 --max-restarts 3 --inject-fault kill:rank=1@step=20
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-id job1 --max-restarts 3 run_ddp_training.py --num-epochs 2     # 2 machines x 2 ranks

:func:`launch` looks at the environment: with torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR``
this process is one rank (:func:`run_torchrun`); otherwise :func:`run_local` starts
``system.num_workers`` ranks on this machine.

The local launcher is torch's own elastic agent (``torch.distributed.launcher.api``), the one
torchrun runs: one node, ``nproc_per_node`` ranks started with ``spawn``, a c10d rendezvous whose
store binds port 0 on 127.0.0.1 (the OS picks a free port: no probe-then-bind race). When a rank
dies, the agent stops the others and starts the group again, up to ``system.max_restarts`` times;
the ranks of a restarted attempt continue from the newest checkpoint of this job (see
:class:`src.ddp.job.JobRecord`). Under torchrun the same happens with torchrun's
``--max-restarts``.

What cannot succeed is not retried: the device, backend, adaptive compression settings, dataset
and ``--resume`` checkpoint are checked here before any rank starts (one ``error:`` line, exit 1),
and an expected error inside a rank stops the later attempts at once. Ctrl-C or SIGTERM to the
launcher: the agent stops every rank, and :class:`KeyboardInterrupt` comes out (exit 130). Ranks
die at once on SIGINT (a rank blocked inside a collective cannot run a Python handler), and the
kernel sends them SIGINT if the launcher itself dies (``PR_SET_PDEATHSIG``), so no rank outlives it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import tempfile
import uuid
from pathlib import Path
from typing import Any

from src.common.checkpoint import load_latest_good
from src.common.child_processes import START_METHOD, use_forkserver
from src.common.supervisor import LaunchError
from src.config import Config, SetupError, validate_config
from src.telemetry import tracing
from src.telemetry.logs import setup_logging
from src.training.data import check_dataset

LOCAL_HOST = "127.0.0.1"
_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
_QUIET_RESOURCE_TRACKER = "ignore:resource_tracker:UserWarning"
MONITOR_INTERVAL_S = 0.1
"""How often the agent looks at its ranks (torchrun's default): a dead rank is noticed within this."""


def torchrun_env(environ: dict[str, str] | None = None) -> dict[str, int] | None:
    """Rank layout from torchrun's environment, or ``None`` when not launched by torchrun."""
    environ = os.environ if environ is None else environ
    if not all(key in environ for key in _TORCHRUN_KEYS):
        return None
    world = int(environ["WORLD_SIZE"])
    return {
        "rank": int(environ["RANK"]),
        "world_size": world,
        "local_rank": int(environ.get("LOCAL_RANK", environ["RANK"])),
        "local_world_size": int(environ.get("LOCAL_WORLD_SIZE", world)),
    }


# ----------------------------------------------------------------------------- checks before any rank starts


def check_launch(config: Config, *, local_world_size: int) -> None:
    """Reject configurations no rank could run, before anything is started.

    Raises:
        SetupError: one line naming the field (device, backend, world size against GPUs, adaptive
            compression without evaluations or top-k, fp16 with compression, link emulation).
    """
    import torch

    from src.ddp.control import config_problem
    from src.ddp.rank import check_rank_setup, rank_device, select_backend
    from src.telemetry.trackers import require_trackers

    problem = config_problem(config)
    if problem is not None:
        raise SetupError(problem)
    require_trackers(config)
    check_rank_setup(config, config.system.num_workers)
    device = rank_device(config.training.device, 0)
    select_backend(config.system.backend, device)
    if device.type == "cuda" and local_world_size > 1:
        if config.training.device.startswith("cuda:"):
            raise SetupError(
                f"training.device: {config.training.device} would put all {local_world_size} local ranks on one GPU; "
                f"use cuda or auto"
            )
        if local_world_size > torch.cuda.device_count():
            raise SetupError(
                f"system.num_workers: {local_world_size} local ranks but only {torch.cuda.device_count()} CUDA devices"
            )


def resolve_resume(config: Config, target: str | Path | None, *, world_size: int) -> str | None:
    """The checkpoint file ``--resume`` points at (newest good one in a folder), checked against the config.

    Raises:
        CheckpointError: nothing loadable, or the checkpoint holds a different model.
        SetupError: the checkpoint was taken mid-epoch with other ranks or batch size.
    """
    from src.ddp.checkpoints import check_resumable

    if target is None:
        return None
    path, checkpoint = load_latest_good(target)
    check_resumable(path, checkpoint, config, world_size)
    return str(path)


def rank_trace(config: Config, rank: int):
    """``system.trace``: this rank's timeline, ``<log_dir>/rank_<r>/trace.json`` (:mod:`src.telemetry.tracing`)."""
    path = Path(config.system.log_dir) / f"rank_{rank}" / tracing.TRACE_FILE
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0  # keep the earlier attempt's trace
    return tracing.trace_to(path, f"rank {rank}", enabled=config.system.trace, restart=restarted)


# ----------------------------------------------------------------------------- local ranks through the elastic agent


def _elastic_rank(config_data: dict, resume: str | None, summary_json: str, error_dir: str) -> None:
    """A rank started by the local elastic agent (it sets RANK, WORLD_SIZE, MASTER_ADDR/PORT...)."""
    from src.ddp.job import EXPECTED_ERRORS
    from src.ddp_trainer import leave_rank_process, run_rank

    # Die at once on SIGINT, the agent's stop signal on Ctrl-C: a rank blocked inside a collective
    # cannot run Python's handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    env = torchrun_env()
    config = validate_config(config_data)
    setup_logging(config.system.log_level)  # a spawned rank starts with logging unconfigured
    try:
        with rank_trace(config, env["rank"]):
            run_rank(config, **env, resume=resume, summary_json=summary_json)
    except EXPECTED_ERRORS as exc:
        reason = Path(error_dir, f"rank_{env['rank']}.txt")
        if not reason.exists():  # the first attempt's reason; later attempts only repeat it
            reason.write_text(str(exc))
        atexit.register(leave_rank_process, 1)
        raise SystemExit(1) from None
    # The agent still collects this function's return value after it returns; the process then
    # leaves at the start of interpreter shutdown (see leave_rank_process).
    atexit.register(leave_rank_process, 0)


class _WithoutTraceback(logging.Filter):
    """Keep the agent's line naming the rank that failed, drop its traceback of torch's own internals."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def _failure_line(exc: Exception, max_restarts: int) -> str:
    """One line for a job the agent gave up on (no rank reported an expected error)."""
    from src.ddp.watchdog import HUNG_PEER_EXIT

    failures = getattr(exc, "failures", {}) or {}
    parts = []
    for rank, failure in failures.items():  # keyed by global rank (torch's ProcessFailure has local_rank only)
        if failure.exitcode == HUNG_PEER_EXIT:
            how = f"found a peer hung (exit {HUNG_PEER_EXIT}; see the rank_hung events)"
        elif failure.exitcode < 0:
            how = f"was killed by {failure.signal_name()}"
        else:
            how = f"exited with status {failure.exitcode}"
        parts.append(f"rank {rank} {how}")
    what = "; ".join(parts) or str(exc).strip().splitlines()[0]
    return f"{what} (restarts used up: --max-restarts {max_restarts})"


def run_local(
    config: Config, *, resume: str | Path | None = None, summary_json: str | Path | None = None
) -> dict[str, Any]:
    """Run ``system.num_workers`` ranks on this machine under torch's elastic agent.

    Returns:
        The run summary (rank 0's ``summary.json``).

    Raises:
        SetupError, CheckpointError, DatasetUnavailableError: bad device/backend/world size, dataset
            or ``resume`` (before any rank starts).
        LaunchError: a rank stopped with an expected error, or ranks kept failing after
            ``system.max_restarts`` restarts.
        KeyboardInterrupt: interrupted (Ctrl-C or SIGTERM); every rank has been stopped.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world, max_restarts = config.system.num_workers, config.system.max_restarts
    check_launch(config, local_world_size=world)
    check_dataset(config.training)
    resume_path = resolve_resume(config, resume, world_size=world)
    summary_path = Path(summary_json) if summary_json else Path(config.system.log_dir) / "summary.json"
    # We say what happened; torch's "Terminating process ..." warnings and tracebacks only add noise,
    # and so does multiprocessing's resource tracker about the semaphore a SIGKILLed rank could not
    # release (the tracker, started with this environment, cleans it up either way).
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_WithoutTraceback())
    if _QUIET_RESOURCE_TRACKER not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(
            filter(None, [os.environ.get("PYTHONWARNINGS"), _QUIET_RESOURCE_TRACKER])
        )
    use_forkserver()
    with tempfile.TemporaryDirectory(prefix="ddp_launch_") as scratch:
        error_dir = Path(scratch, "errors")
        error_dir.mkdir()
        launch_config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world,
            run_id=f"ddp-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d",
            rdzv_endpoint=f"{LOCAL_HOST}:0",
            local_addr=LOCAL_HOST,
            max_restarts=max_restarts,
            monitor_interval=MONITOR_INTERVAL_S,
            start_method=START_METHOD,
            logs_specs=DefaultLogsSpecs(log_dir=str(Path(scratch, "agent"))),
        )
        try:
            elastic_launch(launch_config, _elastic_rank)(
                config.to_dict(), resume_path, str(summary_path), str(error_dir)
            )
        except SignalException:
            raise KeyboardInterrupt from None
        except ChildFailedError as exc:
            reasons = sorted({path.read_text() for path in error_dir.glob("rank_*.txt")})
            raise LaunchError("; ".join(reasons) if reasons else _failure_line(exc, max_restarts)) from None
    return json.loads(summary_path.read_text())


# ----------------------------------------------------------------------------- one rank of torchrun


def run_torchrun(
    config: Config,
    *,
    world_size_flag: int | None = None,
    resume: str | Path | None = None,
    summary_json: str | Path | None = None,
) -> dict[str, Any]:
    """Run this process as the rank torchrun assigned it (restarts are torchrun's ``--max-restarts``).

    Raises:
        SetupError: ``--world-size`` disagrees with torchrun's WORLD_SIZE, or bad device/backend.
    """
    from src.ddp_trainer import run_rank

    env = torchrun_env()
    if env is None:
        raise SetupError("not launched by torchrun: RANK, WORLD_SIZE and MASTER_ADDR must be set")
    if world_size_flag is not None and world_size_flag != env["world_size"]:
        raise SetupError(f"--world-size {world_size_flag} disagrees with torchrun's WORLD_SIZE={env['world_size']}")
    config = validate_config(
        {**config.to_dict(), "system": {**config.to_dict()["system"], "num_workers": env["world_size"]}}
    )
    check_launch(config, local_world_size=env["local_world_size"])
    with rank_trace(config, env["rank"]):
        return run_rank(config, **env, resume=resume, summary_json=summary_json)


def launch(
    config: Config,
    *,
    world_size_flag: int | None = None,
    resume: str | Path | None = None,
    summary_json: str | Path | None = None,
) -> dict[str, Any]:
    """torchrun environment -> be one rank; otherwise start ``system.num_workers`` local ranks."""
    if torchrun_env() is not None:
        return run_torchrun(config, world_size_flag=world_size_flag, resume=resume, summary_json=summary_json)
    return run_local(config, resume=resume, summary_json=summary_json)
